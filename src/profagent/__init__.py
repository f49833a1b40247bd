"""profagent: observe PyTorch training jobs from the outside."""

__version__ = "0.1.0"

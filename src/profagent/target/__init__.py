"""The target: what we watch, resolved into a process tree on every tick.

``PidTarget`` follows one job from a PID (``attach``); ``NodeTarget`` finds every job on
the node (``watch``). Both return a ``ProcessTree``.
"""

from profagent.contracts import (
    ROLE_DATALOADER,
    ROLE_LAUNCHER,
    ROLE_MAIN,
    ProcessInfo,
    ProcessTree,
)
from profagent.target.pid import PidTarget, check_attachable, not_a_training_job

__all__ = [
    "ROLE_DATALOADER", "ROLE_LAUNCHER", "ROLE_MAIN", "PidTarget", "ProcessInfo", "ProcessTree", "check_attachable", "not_a_training_job",
]

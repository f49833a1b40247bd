"""PyTorch Lightning started as its docs say (tests/workloads/lightning_job.py: `python
lightning_job.py`, Trainer(accelerator="cpu", devices=2, strategy="ddp"): Lightning's own
launcher starts rank 1 as rank 0's child), watched by one `profagent attach` on rank 0
through the phases of helpers/frameworks.py: healthy, its figures against the job's own
Callback log at a 60 s checkpoint pause (Lightning's optimizer.step(closure) runs the
forward and backward inside torch's Optimizer.step block), the pause, a straggler, a hang."""

from __future__ import annotations

import os

import pytest

from helpers.frameworks import phase_tests

# phases of one job, in file order: they share its CPU time (start-up is the most of it)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="kernel probes need root")]

globals().update(phase_tests("lightning", "lightning_job.py", launcher="self", env=None))

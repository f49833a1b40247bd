"""accelerate (tests/workloads/accelerate_job.py: Accelerator(gradient_accumulation_steps=4)
and accelerator.accumulate) under torchrun, 2 ranks over gloo, watched by one `profagent
attach` through the phases of helpers/frameworks.py: healthy, its figures against the
job's own log at a 60 s checkpoint pause, the pause, a straggler, a hang."""

from __future__ import annotations

import os

import pytest

from helpers.frameworks import phase_tests

# phases of one job, in file order: they share its CPU time (start-up is the most of it)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="kernel probes need root")]

globals().update(phase_tests("accelerate", "accelerate_job.py", launcher="torchrun", env={"FW_ACCUM": "4"}))

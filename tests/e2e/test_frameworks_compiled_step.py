"""A compiled optimizer step (tests/workloads/compile_job.py with FW_COMPILE=step:
torch.compile(opt.step), where dynamo drops Optimizer.step's record_function block) under
torchrun, 2 ranks over gloo, watched by one `profagent attach`: the steps still come from
the probes (another boundary than the missing block), counted exactly and timed as the
job's own clock around the compiled call says, with no finding on a healthy run."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from helpers import frameworks
from helpers.frameworks import Watched

# phases of one job, in file order: they share its CPU time (start-up is the most of it)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="kernel probes need root")]


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Watched]:
    yield from frameworks.watch(tmp_path_factory.mktemp("compiled_step"), "compile_job.py", env={"FW_COMPILE": "step"})


@pytest.mark.timeout(240)
def test_a_healthy_phase_gets_no_finding(watched: Watched) -> None:
    frameworks.healthy(watched)


@pytest.mark.timeout(120)
def test_the_step_figures_match_the_jobs_own_clock(watched: Watched) -> None:
    frameworks.figures_at_the_pause(watched)

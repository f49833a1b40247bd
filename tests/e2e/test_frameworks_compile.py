"""torch.compile of a DDP model (tests/workloads/compile_job.py, inductor) under torchrun,
2 ranks over gloo, watched by one `profagent attach` through the phases of
helpers/frameworks.py: healthy, its figures against the job's own log at a 60 s
checkpoint pause, the pause, a straggler, a hang. The compiled optimizer step
(torch.compile(opt.step), no Optimizer.step block) is test_frameworks_compiled_step.py."""

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
    yield from frameworks.watch(tmp_path_factory.mktemp("compile"), "compile_job.py", launcher="torchrun", env={"FW_COMPILE": "model"})


@pytest.mark.timeout(240)
def test_a_healthy_phase_gets_no_finding(watched: Watched) -> None:
    frameworks.healthy(watched)


@pytest.mark.timeout(120)
def test_the_step_figures_match_the_jobs_own_callbacks(watched: Watched) -> None:
    frameworks.figures_at_the_pause(watched)


@pytest.mark.timeout(120)
def test_a_checkpoint_pause_of_a_minute_never_becomes_a_hang(watched: Watched) -> None:
    frameworks.pause(watched)


@pytest.mark.timeout(180)
def test_a_straggler_is_named_within_a_minute_and_held(watched: Watched) -> None:
    frameworks.straggler(watched)


@pytest.mark.timeout(120)
def test_a_hang_is_warned_with_the_users_line(watched: Watched) -> None:
    frameworks.hang(watched)

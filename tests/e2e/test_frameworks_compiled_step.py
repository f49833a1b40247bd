"""A compiled optimizer step (tests/workloads/compile_job.py with FW_COMPILE=step:
torch.compile(opt.step), where dynamo drops Optimizer.step's record_function block) under
torchrun, 2 ranks over gloo, watched by one `profagent attach`: the steps still come from
the probes (another boundary than the missing block, which /api/ranks names), counted
exactly and timed as the job's own clock at that boundary says, with no finding on a
healthy run."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from helpers import frameworks
from helpers.agent import http_get
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


def test_the_ranks_say_where_their_steps_come_from(watched: Watched) -> None:
    """No Optimizer.step block: /api/ranks names the boundary used instead and what the user
    can do to have the block back."""
    bound = frameworks.step_boundaries(watched.url)
    assert sorted(bound) == ["0", "1"] and set(bound.values()) <= {"zero_grad", "backward"}, bound
    rows = [r for j in json.loads(http_get(watched.url + "/api/ranks"))["jobs"] for r in j["ranks"]]
    assert all("capture_profiler_record_function" in r["timeline"]["steps_note"] for r in rows), rows

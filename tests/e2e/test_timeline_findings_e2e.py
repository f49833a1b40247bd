"""Findings from the step timeline on real torchrun jobs (tests/workloads/timeline_job.py):
a straggler named from its collective arrivals and a healthy job with no finding (the
stall warning is in test_timeline_stall_e2e.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from helpers.processes import wait_for
from helpers.timeline import Job, attach, findings, metrics
from profagent.config import FindingsConfig

pytestmark = [pytest.mark.slow_first, pytest.mark.skipif(os.geteuid() != 0, reason="kernel probes need root")]


def test_a_rank_slower_by_half_is_named_the_straggler_from_its_arrivals(tmp_path: Path, run_agent) -> None:
    job = Job(tmp_path, 2, "--slow-rank", "1", "--slow-factor", "1.5", "--seconds", "90", "--workers", "0")
    try:
        url = attach(run_agent, job)
        began = time.monotonic()
        job.start_file.write_text("go")

        def named() -> dict | None:
            return next((f for f in findings(url)["findings"]
                         if f["finding"] == "straggler" and f["evidence"].get("signal") == "arrivals"), None)

        found = wait_for(named, 60, interval=1.0, what="a straggler named from arrivals")
        assert time.monotonic() - began < 60
        assert found["rank"] == "1", found
        assert found["evidence"]["last_share"] >= FindingsConfig().arrival_last_share
    finally:
        job.stop()


def test_a_healthy_job_gets_no_straggler_nor_any_other_finding(tmp_path: Path, run_agent) -> None:
    """Every evaluation of 45 s of a healthy 2-rank DDP job with DataLoader workers is
    read (the evaluation counter proves the agent looked), and none holds a finding."""
    job = Job(tmp_path, 2, "--seconds", "45", "--workers", "2", "--linger", "60")  # read after its steps
    try:
        url = attach(run_agent, job)
        job.start_file.write_text("go")
        seen: set[int] = set()
        deadline = time.monotonic() + 150  # a minute of steps, plus start-up and teardown on a loaded node
        while not job.done() and time.monotonic() < deadline:
            answer = findings(url)
            seen.add(answer["evaluations"])
            assert answer["findings"] == [], [(f["summary"], f["evidence"]) for f in answer["findings"]]
            time.sleep(0.5)
        assert job.done(), "the job did not finish its minute"
        assert len(seen) >= 45  # evaluations looked at: one a tick (0.5 s), read every 0.5 s
        m = metrics(url)
        assert all(v > 0 for _, v in m["profagent_collective_arrival_lag_seconds_count"])
    finally:
        job.stop()

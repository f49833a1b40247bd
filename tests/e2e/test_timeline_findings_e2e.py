"""Findings from the step timeline on real torchrun jobs (tests/workloads/timeline_job.py):
a straggler named from its collective arrivals, a healthy job with no finding, and the
stall warning (a checkpoint save that clears, a stuck rank named long before a hang)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from helpers.processes import wait_for
from helpers.timeline import Job, attach, findings, metrics
from profagent.config import FindingsConfig

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="kernel probes need root")


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
    job = Job(tmp_path, 2, "--seconds", "45", "--workers", "2")
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


def test_a_save_warns_then_clears_and_a_stuck_rank_is_named_four_times_sooner_than_a_hang(tmp_path: Path,
                                                                                          run_agent) -> None:
    """The defaults (a warning at 30 s, a hang at 120 s) scaled down by 2.5 to keep the
    suite short: a warning at 12 s, a hang at 48 s. Rank 0 saves a checkpoint for 25 s
    while rank 1 waits at the barrier: at most a `stall` warning naming the save's line,
    gone once steps resume, never a `hang`. Then rank 1 stops for good in its forward: a
    `stall` naming rank 1 and its line by a quarter of the hang's time."""
    warn_after, hang_after = 12.0, 48.0
    job = Job(tmp_path, 2, "--steps", "100000", "--workers", "0", "--save-at-step", "60", "--save-seconds", "25",
              "--hang-at-step", "300")
    try:
        config = tmp_path / "profagent.toml"
        config.write_text(f"[stacks]\nstall_seconds = {hang_after}\n[findings]\nstall_warning_seconds = {warn_after}\n")
        url = attach(run_agent, job, extra=["--config", str(config)])  # stacks on: the lines come from them
        job.start_file.write_text("go")

        def stall() -> dict | None:
            return next((f for f in findings(url)["findings"] if f["finding"] == "stall"), None)

        def stall_at(line: str) -> dict | None:
            found = stall()
            # its line comes from a stack sampled since the rank stopped: absent until one is back
            return found if found and line in found["summary"] else None

        wait_for(lambda: (job.dir / "saving").exists(), 120, interval=0.2, what="the save")
        during = wait_for(lambda: stall_at("save_checkpoint (timeline_job.py:"), warn_after + 10, interval=0.5,
                          what="a stall warning naming the save's line")
        assert during["rank"] == "0", during["summary"]
        wait_for(lambda: (job.dir / "saved1").exists(), 60, interval=0.2, what="the save's end")
        wait_for(lambda: stall() is None, 20, interval=0.5, what="the warning to clear once steps resume")
        hanging = wait_for(lambda: (job.dir / "hanging").exists() and float((job.dir / "hanging").read_text()), 300,
                           interval=0.2, what="rank 1 to stop")
        found = wait_for(lambda: stall_at("stuck_in_forward (timeline_job.py:"), warn_after + 10, interval=0.5,
                         what="a stall naming the stuck rank's line")
        named_after = time.monotonic() - hanging
        assert found["rank"] == "1", found["summary"]
        assert named_after <= hang_after / 4 + 5, named_after
        assert not any(f["finding"] == "hang" for f in findings(url)["findings"])
    finally:
        job.stop()

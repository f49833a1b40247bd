"""Findings from the step timeline on real torchrun jobs (tests/workloads/timeline_job.py):
a straggler named from its collective arrivals (DDP, and FSDP2 with a rank of twice the
compute), a healthy job with no finding, and the stall warning (a checkpoint save that
clears, a stuck rank named long before a hang)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
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


def test_an_fsdp2_rank_with_twice_the_compute_is_named_the_straggler(tmp_path: Path, run_agent) -> None:
    """FSDP2 (``fully_shard`` on each layer, gloo) where rank 1 computes each layer twice,
    forward and backward, as a device of half the speed would. The arrival thresholds are
    scaled down (20 s of window, 10 s of span instead of 60 and 30) to keep the test short;
    the shares are the defaults. Checked: the finding's rank, text and advice, `diagnose`,
    `top --once`, and the job's own account of each rank's forward compute."""
    job = Job(tmp_path, 2, "--fsdp2", "--slow-rank", "1", "--slow-layers", "--seconds", "45", "--workers", "0")
    try:
        config = tmp_path / "profagent.toml"
        config.write_text("[timeline]\nwindow_seconds = 20\n[findings]\narrival_min_seconds = 10\n")
        url = attach(run_agent, job, extra=["--no-stacks", "--config", str(config)])
        job.start_file.write_text("go")

        def named() -> dict | None:
            return next((f for f in findings(url)["findings"] if f["finding"] == "straggler"), None)

        found = wait_for(named, 60, interval=1.0, what="a straggler named from arrivals")
        assert found["rank"] == "1" and found["evidence"]["signal"] == "arrivals", found
        assert found["summary"].startswith("rank 1 is the straggler: it called "), found["summary"]
        assert found["evidence"]["last_share"] >= FindingsConfig().arrival_last_share
        assert found["evidence"]["lag_share"] >= FindingsConfig().arrival_lag_share
        assert "balance the work" in found["advice"], found
        env = {**os.environ, "COLUMNS": "400"}
        out = subprocess.run([sys.executable, "-m", "profagent", "diagnose", "--url", url], capture_output=True,
                             text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        assert "rank 1 is the straggler" in out.stdout and f"what to do: {found['advice']}" in out.stdout, out.stdout
        top = subprocess.run([sys.executable, "-m", "profagent", "top", "--url", url, "--once"], capture_output=True,
                             text=True, timeout=60, env=env)
        assert top.returncode == 0, top.stderr
        assert "straggler (rank 1): rank 1 is the straggler" in top.stdout, top.stdout
        rows = {x.split()[0]: x for x in top.stdout.splitlines() if x.split()[:1] in (["0"], ["1"])}
        assert "SLOW" in rows["1"] and "SLOW" not in rows["0"], top.stdout
        # the job's own account: rank 1's layers took about twice as long as rank 0's
        wait_for(job.done, 120, interval=0.5, what="the job's end")
        forward = [statistics.median(s["forward_compute"] for s in job.truth(r)["stages"][5:]) for r in (0, 1)]
        assert forward[1] >= 1.5 * forward[0], forward
        others = [f for f in findings(url)["findings"] if f["finding"] != "straggler" or f["rank"] != "1"]
        assert others == [], [(f["summary"], f["evidence"]) for f in others]
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

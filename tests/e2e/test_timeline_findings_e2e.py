"""Findings from the step timeline on real torchrun jobs (tests/workloads/timeline_job.py):
a straggler named from its collective arrivals (DDP, and FSDP2 with a rank of twice the
compute) and a healthy job with no finding (the stall warning is in
test_timeline_stall_e2e.py)."""

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

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="kernel probes need root")]


def test_a_rank_slower_by_half_is_named_the_straggler_from_its_arrivals(tmp_path: Path, run_agent) -> None:
    """A job whose host waits 40 ms a step for its device, as GPU jobs do, where rank 1's
    device takes half as long again: rank 1 arrives last at every collective, by about a
    quarter of its step. (The devices are sleeps and the batches small: the suite's CPUs
    stay free for the other tests.)"""
    job = Job(tmp_path, 2, "--slow-rank", "1", "--slow-factor", "1.5", "--device-seconds", "0.04", "--seconds", "90",
              "--workers", "0", "--batch", "8")
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
        assert found["evidence"]["step_last_share"] >= FindingsConfig().arrival_last_share
    finally:
        job.stop()


def test_an_fsdp2_rank_with_twice_the_compute_is_named_the_straggler(tmp_path: Path, run_agent) -> None:
    """FSDP2 (``fully_shard`` on each layer, gloo) where rank 1 computes each layer twice,
    forward and backward, as a device of half the speed would. The arrival thresholds are
    scaled down (20 s of window, 10 s of span instead of 60 and 30) to keep the test short;
    the shares are the defaults. Each step also waits 20 ms on the rest of its device's work
    (a sleep, the same on both ranks), so the two ranks leave the suite's CPUs half the time.
    Checked: the finding's rank, text and advice, `diagnose`, `top --once`, and the job's
    own account of each rank's forward compute."""
    job = Job(tmp_path, 2, "--fsdp2", "--slow-rank", "1", "--slow-layers", "--seconds", "45", "--workers", "0",
              "--device-seconds", "0.02")
    try:
        config = tmp_path / "profagent.toml"
        config.write_text("[timeline]\nwindow_seconds = 20\n[findings]\narrival_min_seconds = 10\n")
        url = attach(run_agent, job, extra=["--no-stacks", "--config", str(config)])
        job.start_file.write_text("go")

        def named() -> dict | None:
            return next((f for f in findings(url)["findings"] if f["finding"] == "straggler"), None)

        found = wait_for(named, 60, interval=1.0, what="a straggler named from arrivals")
        assert found["rank"] == "1" and found["evidence"]["signal"] == "arrivals", found
        assert found["summary"].startswith("rank 1 is the straggler: it lagged the most at "), found["summary"]
        assert found["evidence"]["step_last_share"] >= FindingsConfig().arrival_last_share
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
    read (the evaluation counter proves the agent looked), and none holds a finding. Its
    host waits 30 ms a step for its device, as in the straggler's job above (the flat-out
    healthy job is test_collectives_e2e's, the five-minute ones test_healthy_jobs_e2e's)."""
    job = Job(tmp_path, 2, "--seconds", "45", "--workers", "2", "--device-seconds", "0.03", "--batch", "8",
              "--linger", "60")  # read after its steps
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

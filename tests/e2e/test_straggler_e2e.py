"""The arrival straggler on real torchrun jobs (tests/workloads/trainer_like.py, DDP over
gloo) under a real `profagent attach` whose kernel probes are its only signal: a straggler
behind HF ``Trainer``'s per-step gather (which re-aligns the ranks before the DDP buckets)
named within a minute of its slowdown and held while it lasts, after a healthy phase that
names no one; and a rank whose DataLoader is slow named with that cause, against the job's
own account of its data wait."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import pytest

from helpers.paths import ROOT
from helpers.processes import wait_for
from helpers.timeline import Job, attach, findings
from profagent.config import FindingsConfig

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="kernel probes need root")]

WORKLOAD = ROOT / "tests" / "workloads" / "trainer_like.py"


def stragglers(url: str) -> list[dict]:
    return [f for f in findings(url)["findings"] if f["finding"] == "straggler"]


# `make test-long`: test_frameworks_hf_trainer.py holds the same on a real HF Trainer in
# `make test`; this plain-torch model of it (three minutes) keeps the suite within its budget
@pytest.mark.long
@pytest.mark.timeout(420)  # a healthy phase, up to a minute to name it, a minute held, the job's end
def test_a_trainer_like_straggler_is_named_within_a_minute_and_held_while_it_lasts(tmp_path: Path, run_agent) -> None:
    """40 s healthy (no straggler at any poll), then rank 1's device takes 1.5 times as long
    (60 ms against 40 a step): late at each step's gather, a coin toss at the ten buckets
    after it. Named within 60 s of the slowdown, then at every poll for 60 s."""
    straggle = tmp_path / "straggle"
    job = Job(tmp_path, 2, "--seconds", "160", "--slow-rank", "1", "--slow-factor", "1.5", "--device-seconds", "0.04",
              "--straggle-file", str(straggle), "--linger", "60", workload=WORKLOAD)
    try:
        url = attach(run_agent, job)
        job.start_file.write_text("go")
        healthy_until = time.monotonic() + 40.0
        while time.monotonic() < healthy_until:
            assert stragglers(url) == [], stragglers(url)
            time.sleep(1.0)
        straggle.write_text("now")
        began = time.monotonic()
        found = wait_for(lambda: stragglers(url) or None, 60, interval=1.0, what="a straggler named from arrivals")
        named_after = time.monotonic() - began
        print(f"named {named_after:.1f} s after the slowdown: {found[0]['summary']}")
        assert [f["rank"] for f in found] == ["1"] and found[0]["evidence"]["signal"] == "arrivals", found
        assert named_after < 60.0
        held_until = time.monotonic() + 60.0
        seen = []
        while time.monotonic() < held_until:
            now = stragglers(url)
            assert [f["rank"] for f in now] == ["1"], (time.monotonic() - began, now)
            seen.append(now[0]["evidence"])
            time.sleep(1.0)
        cfg = FindingsConfig()
        assert all(e["step_last_share"] >= cfg.arrival_last_share for e in seen[-5:]), seen[-1]
        # the job's own account: rank 1's device took 60 ms a step from the slowdown on,
        # rank 0's 40: rank 1's largest lag of a step is those 20 ms, at the gather; at the
        # ten buckets after it either rank is last, and its median lag is far less
        wait_for(job.done, 120, interval=0.5, what="the job's end")
        truth = [job.truth(r) for r in (0, 1)]
        assert truth[1]["straggling_since"] is not None and truth[0]["straggling_since"] is None
        extra = statistics.median(s["device"] for s in truth[1]["steps"][-100:]) \
            - statistics.median(s["device"] for s in truth[0]["steps"][-100:])
        last = seen[-1]
        assert last["step_max_lag_seconds"] == pytest.approx(extra, abs=0.01), (last, extra)
        assert last["median_lag_seconds"] < last["step_max_lag_seconds"] / 2, last
    finally:
        job.stop()


def test_a_slow_dataloader_straggler_is_named_with_its_cause(tmp_path: Path, run_agent) -> None:
    """Plain DDP (no gather): rank 0's DataLoader worker takes 4 ms more a sample (64 ms a
    batch against a step of about 50 ms), rank 1 waits for it in its backward. The straggler
    is rank 0 and the cause its DataLoader, its data wait share within 5 points of the job's
    own account."""
    job = Job(tmp_path, 2, "--seconds", "90", "--no-gather", "--slow-loader-rank", "0", "--loader-seconds", "0.004",
              "--device-seconds", "0.03", "--linger", "60", workload=WORKLOAD)
    try:
        url = attach(run_agent, job)
        job.start_file.write_text("go")
        found = wait_for(lambda: stragglers(url) or None, 80, interval=1.0, what="a straggler named from arrivals")
        [f] = found
        print(f["summary"])
        assert f["rank"] == "0" and f["evidence"]["cause"] == "data_wait", f
        assert "its DataLoader" in f["summary"] and "DataLoader workers" in f["advice"], f
        wait_for(job.done, 120, interval=0.5, what="the job's end")
        own = [sum(s["data_wait"] for s in job.truth(r)["steps"]) / (job.truth(r)["calls"][-1] - job.truth(r)["calls"][0])
               for r in (0, 1)]
        assert own[0] > own[1] + 0.1, own  # the job's own account: rank 0 waits for its data, rank 1 not
        mine, others = f["evidence"]["stage_shares"]["data_wait"], f["evidence"]["others_stage_shares"]["data_wait"]
        assert mine == pytest.approx(own[0], abs=0.05) and others == pytest.approx(own[1], abs=0.05), (f, own)
        assert f"Its data wait is {mine:.0%} of its step against {others:.0%} on the others: its DataLoader" in f["summary"]
    finally:
        job.stop()

"""The step timeline on real jobs written as users write them (tests/workloads/timeline_job.py),
started with no profiler and no environment variable, observed by a real `profagent attach`
whose kernel probes are the only source of step figures.

Each job waits for a start file, so the agent's probes are in place before its first
step, and logs its own step calls and stage times; the exported figures are checked
against that log: step count exact, p50 step time within 2%, stage shares within 2 points.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from helpers.agent import http_get
from helpers.processes import wait_for
from helpers.timeline import Job, attach, check_rank, expected, metrics, value
from profagent.analysis.timeline import quantile

# the window of the p50 covers the whole job, even when a loaded node makes it run long
WHOLE_JOB = {"PROFAGENT_TIMELINE_WINDOW_SECONDS": "900"}
WINDOW = 6  # seconds: the timeline window of the regression test, 10 slow steps and more

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="kernel probes need root")]


def run(tmp_path: Path, run_agent, ranks: int, *args: str, with_url: bool = False):
    """Start the job and an agent on it; start the steps once every rank is probed; return
    the job and the agent's last metrics once the job has logged its truth (and the
    agent's URL with ``with_url``)."""
    job = Job(tmp_path, ranks, *args, "--linger", "120")  # the agent attached to it exits with it
    try:
        url = attach(run_agent, job, env=WHOLE_JOB)
        job.start_file.write_text("go")
        wait_for(job.done, 240, interval=0.5, what="the job's steps")
        truths = [job.truth(r) for r in range(ranks)]

        def caught_up() -> dict | None:
            m = metrics(url)
            counts = [value(m, "profagent_step_seconds_count", rank=str(r)) for r in range(ranks)]
            return m if counts == [float(len(t["calls"]) - 1) for t in truths] else None

        m = wait_for(caught_up, 30, interval=0.5, what="the agent's step count to reach the job's")
        return (job, m, url) if with_url else (job, m)
    except BaseException:
        job.stop()
        raise


def test_ddp_with_dataloader_workers_matches_the_jobs_own_log(tmp_path: Path, run_agent) -> None:
    job, m = run(tmp_path, run_agent, 2, "--workers", "2", "--steps", "120")
    try:
        for rank in range(2):
            check_rank(m, job.truth(rank), rank)
            assert value(m, "profagent_step_micro_batches", rank=str(rank)) == pytest.approx(1.0)
            # DDP's bucket all_reduces: every rank's arrivals were matched across ranks
            assert value(m, "profagent_collective_arrival_lag_seconds_count", rank=str(rank)) > 0
    finally:
        job.stop()


def test_gradient_accumulation_counts_micro_batches(tmp_path: Path, run_agent) -> None:
    job, m = run(tmp_path, run_agent, 1, "--accum", "4", "--steps", "60", "--workers", "0")
    try:
        truth = job.truth(0)
        check_rank(m, truth, 0)
        assert value(m, "profagent_backward_passes_total", rank="0") == 4 * len(truth["calls"])
        assert value(m, "profagent_step_micro_batches", rank="0") == pytest.approx(4.0)
    finally:
        job.stop()


def test_a_slow_dataloader_on_one_rank_shows_as_its_data_wait(tmp_path: Path, run_agent) -> None:
    job, m = run(tmp_path, run_agent, 2, "--slow-loader-rank", "1", "--workers", "1", "--steps", "100")
    try:
        for rank in range(2):
            check_rank(m, job.truth(rank), rank)
        total = {r: value(m, "profagent_step_seconds_sum", rank=str(r)) for r in ("0", "1")}
        wait = {r: value(m, "profagent_step_stage_seconds_total", stage="data_wait", rank=r) / total[r] for r in total}
        assert wait["1"] > wait["0"] + 0.1, wait
    finally:
        job.stop()


def test_a_closure_optimizer_counts_its_forward_and_backward_once(tmp_path: Path, run_agent) -> None:
    """``optimizer.step(closure)`` as Lightning calls it: the closure's forward, zero_grad
    and backward run inside Optimizer.step's block. The k-th interval holds the closure
    and update of step k and the data wait of step k+1; the optimizer is the step's call
    less its closure, plus the closure's zero_grad, as the job times them."""
    job, m = run(tmp_path, run_agent, 2, "--closure", "--workers", "1", "--steps", "120")
    try:
        for rank in range(2):
            truth = job.truth(rank)
            stages, total = truth["stages"], sum(expected(truth)[0])
            shares = {"data_wait": sum(s["data_wait"] for s in stages[1:]) / total,
                      "backward": sum(s["backward"] for s in stages[:-1]) / total,
                      "optimizer": sum(s["optimizer"] for s in stages[:-1]) / total}
            check_rank(m, truth, rank, shares)
            assert value(m, "profagent_optimizer_steps_total", rank=str(rank)) == len(truth["calls"])
    finally:
        job.stop()


def test_a_compiled_optimizer_step_takes_its_steps_from_the_backward_passes(tmp_path: Path, run_agent) -> None:
    """torch.compile of the model and of opt.step(), gradients zeroed by the model's
    zero_grad() (HF's Trainer's way): dynamo drops Optimizer.step's record_function, so the
    steps begin at each backward pass (DDP's: one a step). The job logs each backward's start: count exact, p50 within 2%; the
    optimizer's update is other, and /api/ranks says where the steps come from."""
    job, m, url = run(tmp_path, run_agent, 2, "--compile", "--workers", "0", "--steps", "120", with_url=True)
    try:
        for rank in range(2):
            truth = job.truth(rank)
            stages, total = truth["stages"], sum(expected(truth)[0])
            shares = {"data_wait": sum(s["data_wait"] for s in stages[1:]) / total,
                      "backward": sum(s["backward"] for s in stages[:-1]) / total, "optimizer": 0.0}
            check_rank(m, truth, rank, shares)
            # the steps begun, each at its backward: the job's throughput for dashboards
            assert value(m, "profagent_optimizer_steps_total", rank=str(rank)) == len(truth["calls"])
        rows = [r for j in json.loads(http_get(url + "/api/ranks"))["jobs"] for r in j["ranks"]]
        assert {r["timeline"]["step_boundary"] for r in rows} == {"backward"}
        assert all("capture_profiler_record_function" in r["timeline"]["steps_note"] for r in rows)
    finally:
        job.stop()


def test_a_backward_that_raises_leaves_the_job_running(tmp_path: Path, run_agent) -> None:
    """A return probe would abort the process when a C++ exception crosses it; ours are
    entry probes, so a caught backward error stays a Python exception."""
    job, m = run(tmp_path, run_agent, 1, "--raise-in-backward", "--steps", "40", "--workers", "0")
    try:
        truth = job.truth(0)
        assert truth["raised"] == 40
        check_rank(m, truth, 0)
    finally:
        job.stop()


def test_a_job_that_also_writes_traces_gets_the_same_step_time_from_both(tmp_path: Path, run_agent) -> None:
    """A job profiling every step, a trace each 40: the trace's step time (the mean of its
    ProfilerSteps) and the probes' (from one Optimizer.step call to the next) each match
    the job's own log over the steps they cover. ProfilerStep#N runs from the profiler
    step after optimizer step N to the one after step N+1: the job's N-th interval."""
    traces = tmp_path / "traces"
    traces.mkdir()
    job = Job(tmp_path, 1, "--steps", "90", "--workers", "0", "--profile-dir", str(traces), "--profile-steps", "40",
              "--linger", "120")  # the agent attached to it exits with it
    try:
        url = attach(run_agent, job, extra=["--no-stacks", "--trace-dir", str(traces)], env=WHOLE_JOB)
        job.start_file.write_text("go")
        wait_for(job.done, 180, interval=0.5, what="the job's steps")
        truth = job.truth(0)
        intervals, _ = expected(truth)
        written = sorted(traces.glob("*.pt.trace.json*"), key=lambda p: p.stat().st_mtime)
        assert len(written) == 2  # 90 steps, cycles of 41 (one warm-up step)

        def both() -> tuple[float, float] | None:
            m = metrics(url)
            traced = value(m, "profagent_trace_step_seconds", rank="0")
            probed = value(m, "profagent_step_window_seconds", stat="p50", rank="0")
            ingested = sum(v for labels, v in m.get("profagent_traces_total", []) if labels.get("status") == "ingested")
            # every step read: on a loaded node the probe reader may still be behind the job
            steps = value(m, "profagent_optimizer_steps_total", rank="0")
            caught_up = steps == float(len(truth["calls"]))
            return (traced, probed) if traced and probed and ingested >= len(written) and caught_up else None

        traced, probed = wait_for(both, 60, interval=0.5, what="the last trace analysed and every step probed")
        events = json.loads(written[-1].read_text())["traceEvents"]
        numbers = [int(e["name"].split("#")[1]) for e in events if e.get("name", "").startswith("ProfilerStep#")]
        assert len(numbers) >= 35, numbers
        covered = [intervals[n - 1] for n in numbers]
        assert traced == pytest.approx(sum(covered) / len(covered), rel=0.05)
        assert probed == pytest.approx(quantile(intervals, 0.5), rel=0.02)
    finally:
        job.stop()


def test_a_step_time_that_regresses_is_captured_from_the_probes_with_no_trace(tmp_path: Path, run_agent) -> None:
    """A job that writes no trace, paced by its device (50 ms a step), whose device then
    gets six times slower: the regression rule runs on the probes' p50 (one value every
    half timeline window of 6 s) and captures an incident. Its baseline and slow step time
    are checked against the job's own log. The job's own compute is kept small (one
    thread, batches of one): on a loaded node it grows tenfold, and the slowdown of its
    steps must still be the device's, above the rule's factor of 2."""
    slow, incidents = tmp_path / "slow", tmp_path / "incidents"
    job = Job(tmp_path, 1, "--seconds", "200", "--workers", "0", "--batch", "1", "--device-seconds", "0.05",
              "--slow-file", str(slow), "--slow-device-seconds", "0.3", "--slow-steps", "60", "--linger", "120",
              env={"OMP_NUM_THREADS": "1"})
    try:
        url = attach(run_agent, job, env={
            "PROFAGENT_TIMELINE_WINDOW_SECONDS": str(WINDOW), "PROFAGENT_INCIDENTS_DIR": str(incidents),
            "PROFAGENT_INCIDENTS_REGRESSION_FACTOR": "2", "PROFAGENT_INCIDENTS_REGRESSION_SECONDS": "2"})
        job.start_file.write_text("go")

        def steps() -> float | None:
            m = metrics(url)
            return value(m, "profagent_optimizer_steps_total", rank="0") \
                if value(m, "profagent_step_window_seconds", stat="p50", rank="0") else None

        # the baseline: p50s of at least 10 steps, fed every 3 s, 3 of them at least. The
        # agent's own step count and clock say it watched that long
        first = wait_for(steps, 60, interval=0.5, what="the probes' p50 of rank 0")
        since = time.monotonic()
        wait_for(lambda: steps() >= first + 100 and time.monotonic() - since >= 2 * WINDOW, 120, interval=0.5,
                 what="two windows and 100 steady steps seen by the agent")
        assert not value(metrics(url), "profagent_incidents_total", kind="regression")  # steady: no incident
        slowed_at = time.monotonic()  # the job's clock too: it logs time.monotonic()
        slow.touch()

        def complete() -> dict | None:
            found = [i for i in json.loads(http_get(url + "/api/incidents"))["incidents"] if i["kind"] == "regression"]
            return found[0] if found and found[0]["status"] == "complete" else None

        incident = wait_for(complete, 120, interval=0.5, what="a complete regression incident")
        wait_for(job.done, 120, interval=0.5, what="the job's log")
        calls = job.truth(0)["calls"]
        intervals = list(zip(calls, calls[1:], strict=False))
        before = [b - a for a, b in intervals if b < slowed_at]
        assert incident["rank"] == "0"
        evidence = json.loads((Path(incident["path"]) / "findings.json").read_text())["trigger"]["evidence"]
        assert evidence["measured_by"] == "kernel probes, no trace"
        # the baseline: the median of several windows' p50 of the steady steps
        assert evidence["baseline_seconds"] == pytest.approx(quantile(before, 0.5), rel=0.1)
        # the slow value: the p50 of one window, as the job's own log gives it for a window
        # ending at one of its steps (the agent's ends between two of them)
        windows = [quantile([b - a for a, b in intervals if a >= end - WINDOW and b <= end], 0.5)
                   for _, end in intervals if end > slowed_at + WINDOW / 2]
        assert min(abs(evidence["step_seconds"] / w - 1) for w in windows) < 0.05, (evidence, windows)
        assert evidence["step_seconds"] > 2 * evidence["baseline_seconds"]
        assert "kernel probes" in (Path(incident["path"]) / "summary.md").read_text()
        assert not value(metrics(url), "profagent_traces_total", status="ingested")  # no trace was read
    finally:
        job.stop()

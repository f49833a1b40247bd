"""`profagent timeline`: the picture of every rank's steps, on real torchrun jobs written as
users write them (tests/workloads/timeline_job.py), observed by real agents whose kernel
probes are the only source, checked against each rank's own log.

A straggler job over two agents (one a rank, as two nodes each see their own ranks) that
one real Prometheus scrapes: `timeline --prometheus --job` finds both agents from the
targets and merges them into one file, which holds the Trace Event Format
(helpers/chrome_trace.py), each rank's step count, step and stage times as its own log
says them, and the straggler's lag as the other rank's wait. A job whose rank 1 stops for
good: the picture from `--url`, and the one every incident bundle holds, show where each
rank stopped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers import chrome_trace
from helpers.agent import free_port
from helpers.processes import wait_for
from helpers.prometheus import Prometheus
from helpers.timeline import Job, attach, metrics, value
from helpers.watch import token
from profagent.analysis.timeline import quantile

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="kernel probes need root")]
STAGE_OF = {"data wait": "data_wait", "backward": "backward", "optimizer": "optimizer"}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profagent", "timeline", *args], capture_output=True, text=True,
                          timeout=120)


def rank_pids(job: Job) -> dict[int, int] | None:
    """Global rank -> PID of each rank process of the job, once all are up."""
    found = {}
    for p in psutil.Process(job.proc.pid).children(recursive=True):
        try:
            env, cmd = p.environ(), " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "timeline_job.py" in cmd and "RANK" in env and "LOCAL_RANK" in env:
            found[int(env["RANK"])] = p.pid
    return found if len(found) == job.ranks else None


def agent_on(run_agent, pid: int, rank: int) -> str:
    """An agent on one rank process (a node seeing only its own rank), once it probes it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent = run_agent(["attach", "--pid", str(pid), "--listen", f"127.0.0.1:{port}", "--gpu-backend", "off",
                       "--interval", "0.5", "--no-stacks"], env={"PROFAGENT_ONDEMAND_ENABLED": "false"})
    agent.wait_healthy(url, timeout=60)

    def probed() -> bool:
        m = metrics(url)
        placed = [v for _, v in m.get("profagent_timeline_probes", [])]
        seen = {labels["rank"] for labels, _ in m.get("profagent_optimizer_steps_total", [])}
        return bool(placed) and max(placed) >= 4 and seen == {str(rank)}

    wait_for(probed, 120, interval=0.5, what=f"probes on rank {rank}")
    return url


def steps_of(doc: dict, rank: int) -> list[dict]:
    track = chrome_trace.rank_track(doc, rank)
    return [e for e in chrome_trace.events(doc, track, "X", "step") if "under way" not in e["name"]]


def check_against_log(doc: dict, truth: dict, rank: int) -> None:
    """Step count exact; p50 step time within 2%; each step's start where the log's call
    is (from the first); stage shares of the drawn slices within 2 points of the log's."""
    calls, stages = truth["calls"], truth["stages"]
    intervals = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    steps = steps_of(doc, rank)
    assert len(steps) == len(intervals), (rank, len(steps), len(intervals))
    drawn = [e["dur"] / 1e6 for e in steps]
    assert quantile(drawn, 0.5) == pytest.approx(quantile(intervals, 0.5), rel=0.02)
    offsets = [(e["ts"] - steps[0]["ts"]) / 1e6 - (c - calls[0]) for e, c in zip(steps, calls, strict=False)]
    assert quantile([abs(o) for o in offsets], 0.5) < 0.002, offsets[:10]
    total = sum(drawn)
    track = chrome_trace.rank_track(doc, rank)
    shares = dict.fromkeys(STAGE_OF.values(), 0.0)
    for e in chrome_trace.events(doc, track, "X", "stage"):
        if e["name"] in STAGE_OF and "open" not in e["args"]:
            shares[STAGE_OF[e["name"]]] += e["dur"] / 1e6 / total
    expected = {"data_wait": sum(s["data_wait"] for s in stages[1:]) / sum(intervals),
                "backward": sum(s["backward"] for s in stages[1:]) / sum(intervals),
                "optimizer": sum(s["optimizer"] for s in stages[:-1]) / sum(intervals)}
    for stage, share in expected.items():
        assert shares[stage] == pytest.approx(share, abs=0.02), (rank, stage, shares, expected)


def test_a_straggler_over_two_agents_merged_through_prometheus_matches_each_rank_s_log(tmp_path: Path, run_agent) -> None:
    """Rank 1's layers compute twice, forward and backward (timeline_job.py --slow-layers):
    it calls each collective late, and rank 0 waits for it in its backward."""
    job_id = f"picture-{token()}"
    job = Job(tmp_path, 2, "--steps", "60", "--workers", "0", "--slow-rank", "1", "--slow-layers", "--linger", "120",
              env={"PET_RDZV_ID": job_id})
    prom = None
    try:
        pids = wait_for(lambda: rank_pids(job), 60, interval=0.3, what="both ranks started")
        urls = [agent_on(run_agent, pids[r], r) for r in (0, 1)]
        prom = Prometheus([u.removeprefix("http://") for u in urls], tmp_path)
        job.start_file.write_text("go")
        wait_for(job.done, 240, interval=0.5, what="the job's steps")
        truths = [job.truth(r) for r in (0, 1)]
        for r, url in enumerate(urls):
            try:
                wait_for(lambda u=url, r=r: value(metrics(u), "profagent_optimizer_steps_total", rank=str(r))
                         == len(truths[r]["calls"]), 60, interval=0.5, what=f"rank {r}'s agent to read every step")
            except BaseException:  # say what it read, and what the ring lost
                m = metrics(url)
                print(f"rank {r}: {len(truths[r]['calls'])} steps logged; its agent read "
                      f"{value(m, 'profagent_optimizer_steps_total', rank=str(r))}, lost "
                      f"{value(m, 'profagent_timeline_events_total', kind='lost')} events")
                raise
        labels = [next(lb for lb, _ in metrics(u)["profagent_optimizer_steps_total"]) for u in urls]
        assert {lb["job_id"] for lb in labels} == {job_id}
        wait_for(lambda: len(prom.query(f'profagent_optimizer_steps_total{{job_id="{job_id}"}}')) == 2, 60,
                 interval=0.5, what="Prometheus scraping both agents")

        out = tmp_path / "merged.json"
        res = cli("--prometheus", prom.url, "--job", job_id, "--seconds", "900", "-o", str(out))
        assert res.returncode == 0, res.stderr
        assert f"wrote {out}: 2 ranks on 2 nodes" in res.stdout and "ui.perfetto.dev" in res.stdout
        doc = json.loads(out.read_text())
        assert chrome_trace.check(doc) == []
        # one process per agent (both on this host: told apart by their address), one track per rank
        assert len(chrome_trace.processes(doc)) == 2
        assert {name.split(" (")[0] for name in chrome_trace.tracks(doc)} == {"rank 0", "rank 1"}
        assert chrome_trace.rank_track(doc, 0)[0] != chrome_trace.rank_track(doc, 1)[0]
        for r in (0, 1):
            check_against_log(doc, truths[r], r)

        # the straggler's lag is the other rank's wait, at every collective of its steps
        calls = {r: [e for e in chrome_trace.events(doc, chrome_trace.rank_track(doc, r), "i", "collective")
                     if "lag_ms" in e["args"]] for r in (0, 1)}
        assert len(calls[0]) == len(calls[1]) >= 50, {r: len(c) for r, c in calls.items()}
        lag = quantile([e["args"]["lag_ms"] for e in calls[1]], 0.5)
        waited = quantile([e["args"]["wait_for_last_ms"] for e in calls[0]], 0.5)
        assert quantile([e["args"]["lag_ms"] for e in calls[0]], 0.5) == 0
        assert waited == pytest.approx(lag, rel=0.01)
        # rank 1 is late by its extra forward at least (the job's own clock of its layers)
        forward = [quantile([s["forward_compute"] for s in t["stages"]], 0.5) * 1e3 for t in truths]
        assert lag > 0.5 * (forward[1] - forward[0]) > 0, (lag, forward)
        # each of rank 0's steps says the wait it holds: the lags of rank 1's calls added up
        per_step = {e["args"]["step"]: e["args"].get("collective_wait_ms") for e in steps_of(doc, 0)}
        lags = {}
        for e in calls[1]:
            lags[e["args"]["step"]] = lags.get(e["args"]["step"], 0.0) + e["args"]["lag_ms"]
        wrong = [(n, per_step[n], v) for n, v in lags.items() if n in per_step and per_step[n] != pytest.approx(v, abs=0.01)]
        assert not wrong, wrong[:5]

        # one agent, one rank asked: only that track
        single = tmp_path / "rank0.json"
        res = cli("--url", urls[0], "--rank", "0", "--seconds", "900", "-o", str(single))
        assert res.returncode == 0, res.stderr
        picture = json.loads(single.read_text())
        assert chrome_trace.check(picture) == [] and list(chrome_trace.tracks(picture)) == [f"rank 0 (PID {pids[0]})"]
        check_against_log(picture, truths[0], 0)
    finally:
        if prom is not None:
            prom.stop()
        job.stop()


def where_each_stopped(doc: dict) -> dict[str, tuple[str, int]]:
    """Rank -> (the stage its step under way is in, collectives it called in that step)."""
    out = {}
    for name, track in chrome_trace.tracks(doc).items():
        [step] = [e for e in chrome_trace.events(doc, track, "X", "step") if "under way" in e["name"]]
        called = [e for e in chrome_trace.events(doc, track, "i", "collective") if e["args"]["step"] == step["args"]["step"]]
        out[name.split()[1]] = (step["args"]["now_in"], len(called))
    return out


def test_a_hang_shows_where_each_rank_stopped_now_and_in_the_incident_bundle(tmp_path: Path, run_agent) -> None:
    """Rank 1 stops for good in its forward at step 40; rank 0 goes on into its backward
    and waits there for rank 1's gradients. The picture from the agent, and the one of a
    bundle captured then, show both."""
    socket_path, incidents = tmp_path / "control.sock", tmp_path / "incidents"
    env = {"PROFAGENT_ONDEMAND_CONTROL_SOCKET": str(socket_path), "PROFAGENT_INCIDENTS_DIR": str(incidents)}
    job = Job(tmp_path, 2, "--steps", "1000", "--workers", "0", "--batch", "8", "--hang-at-step", "40", "--linger", "120")
    try:
        url = attach(run_agent, job, env=env)
        job.start_file.write_text("go")
        wait_for(lambda: (job.dir / "hanging").exists(), 180, interval=0.2, what="rank 1 to stop")
        time.sleep(3)  # rank 0 reaches its backward's wait: milliseconds after rank 1 stopped
        out = tmp_path / "hang.json"
        res = cli("--url", url, "--seconds", "600", "-o", str(out))
        assert res.returncode == 0, res.stderr
        doc = json.loads(out.read_text())
        assert chrome_trace.check(doc) == []
        stopped = where_each_stopped(doc)
        assert stopped["1"] == ("forward/other", 0), stopped
        assert stopped["0"][0] == "backward" and stopped["0"][1] >= 1, stopped
        for r in (0, 1):  # the steps before: 39 optimizer calls, 38 steps done, the 39th under way
            assert [e["args"]["step"] for e in steps_of(doc, r)] == list(range(1, 39))
        # the last probe event of rank 1 is seconds old; rank 0's backward is open since
        track0 = chrome_trace.rank_track(doc, 0)
        [open_block] = [e for e in chrome_trace.events(doc, track0, "X", "stage") if e["args"].get("open")]
        assert open_block["name"] == "backward" and open_block["dur"] > 2e6

        capture = subprocess.run([sys.executable, "-m", "profagent", "incidents", "capture", "--reason", "picture"],
                                 capture_output=True, text=True, timeout=150, env={**os.environ, **env})
        assert capture.returncode == 0, capture.stderr
        [bundle] = [p for p in incidents.iterdir() if p.is_dir()]
        meta = json.loads((bundle / "incident.json").read_text())
        assert "timeline.json" in meta["files"]
        kept = json.loads((bundle / "timeline.json").read_text())
        assert chrome_trace.check(kept) == []
        assert where_each_stopped(kept) == stopped
        assert kept["otherData"]["seconds"] == 300
        shown = subprocess.run([sys.executable, "-m", "profagent", "incidents", "show", bundle.name, "--dir",
                                str(incidents)], capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert f"{bundle}/timeline.json; open it at https://ui.perfetto.dev" in " ".join(shown.stdout.split())
    finally:
        job.stop()


def test_pid_observes_in_process_and_each_step_is_where_the_job_logged_it(tmp_path: Path) -> None:
    """`timeline --pid` on a running torchrun job, with no agent: it places the probes,
    observes --seconds and writes the picture. The job's clock and the probes' are this
    host's CLOCK_MONOTONIC, put on Unix time by the picture: each drawn step of each rank
    starts where the rank logged its optimizer call, and none is missing."""
    job = Job(tmp_path, 2, "--seconds", "40", "--workers", "0", "--batch", "8", "--device-seconds", "0.02",
              "--save-at-step", "5", "--save-seconds", "0.1")  # its "saving" file: the ranks step
    out = tmp_path / "pid.json"
    try:
        job.start_file.write_text("go")
        wait_for(lambda: (job.dir / "saving").exists(), 180, interval=0.2, what="the job's steps")
        res = cli("--pid", str(job.proc.pid), "--seconds", "6", "-o", str(out))
        offset = time.time() - time.monotonic()
        assert res.returncode == 0, res.stderr
        wait_for(job.done, 180, interval=0.5, what="the job's end")
        truths = [job.truth(r) for r in (0, 1)]
    finally:
        job.stop()
    doc = json.loads(out.read_text())
    assert chrome_trace.check(doc) == []
    origin = doc["otherData"]["origin_unix_seconds"]
    for r in (0, 1):
        calls, steps = truths[r]["calls"], steps_of(doc, r)
        assert len(steps) >= 50, (r, len(steps))
        starts = [origin + e["ts"] / 1e6 - offset for e in steps]
        first = min(range(len(calls)), key=lambda i: abs(calls[i] - starts[0]))
        logged = calls[first:first + len(steps) + 1]
        # a preemption between the probe and the job's clock moves one by milliseconds on a
        # loaded node; a step missed or added would move every later one by a step (20 ms+)
        off = [abs(a - b) for a, b in zip(starts, logged, strict=False)]
        assert quantile(off, 0.5) < 0.001 and max(off) < 0.01, (r, quantile(off, 0.5), max(off))
        assert abs(starts[-1] + steps[-1]["dur"] / 1e6 - logged[-1]) < 0.01, r
        intervals = [b - a for a, b in zip(logged, logged[1:], strict=False)]
        assert quantile([e["dur"] / 1e6 for e in steps], 0.5) == pytest.approx(quantile(intervals, 0.5), rel=0.02)

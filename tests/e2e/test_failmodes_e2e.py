"""The ways a real DDP job stops, on real torchrun/gloo CPU jobs (tests/workloads/failmodes.py:
a CNN, DistributedSampler, DataLoader workers, AdamW) observed by a real `profagent attach`:
a hung DataLoader worker, uneven inputs ending in ``barrier()``, a culprit spinning in Python.

Each job logs its own ground truth (the event's file, line and, for the worker, its PID);
each test checks the hang finding's text against it, ``diagnose``'s advice, and for the
worker the incident bundle's files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.agent import free_port, http_get, parse_metrics
from helpers.paths import ROOT
from helpers.processes import kill_tree, wait_for

WORKLOAD = ROOT / "tests" / "workloads" / "failmodes.py"
STALL_SECONDS = 6.0
# From the event to the finding: stall_seconds, a native window or two, and py-spy's start-up
# on a loaded 2-core node (seconds each)
FIND_SECONDS = STALL_SECONDS + 60


class Job:
    def __init__(self, tmp: Path, mode: str) -> None:
        self.dir = tmp / f"job-{mode}"
        self.dir.mkdir()
        self._out = (self.dir / "torchrun.log").open("wb")
        env = {**os.environ, "FAILMODES_LOG": str(self.dir), "FAILMODES_MAX_SECONDS": "240"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
             str(WORKLOAD), mode], stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True, env=env,
            cwd=WORKLOAD.parent,
        )

    def event(self, rank: int, name: str, timeout: float = 120.0) -> dict:
        path = self.dir / f"rank{rank}.jsonl"

        def found() -> dict | None:
            lines = path.read_text().splitlines() if path.exists() else []
            return next((e for e in map(json.loads, (x for x in lines if x.endswith("}"))) if e["event"] == name), None)
        return wait_for(found, timeout, interval=0.2, what=f"rank {rank} {name}")

    def stop(self) -> None:
        kill_tree(self.proc)
        self._out.close()


@pytest.fixture
def job(tmp_path: Path):
    jobs: list[Job] = []

    def start(mode: str) -> Job:
        jobs.append(Job(tmp_path, mode))
        return jobs[-1]

    yield start
    for j in jobs:
        j.stop()


def start_agent(run_agent, tmp_path: Path, pid: int) -> str:
    config = tmp_path / "profagent.toml"
    config.write_text(f"state_dir = '{tmp_path / 'state'}'\n"
                      f"[stacks]\nstall_seconds = {STALL_SECONDS}\nwindow = 2\nrate = 50\n"
                      "[findings]\nwindow_seconds = 20\nmin_samples = 30\n"
                      "[ondemand]\nenabled = false\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent = run_agent(["attach", "--pid", str(pid), "--listen", f"127.0.0.1:{port}", "--config", str(config),
                       "--gpu-backend", "off", "--interval", "0.5"])
    agent.wait_healthy(url, timeout=60)
    return url


def findings(url: str) -> list[dict]:
    return json.loads(http_get(url + "/api/findings"))["findings"]


def wait_hang(url: str, predicate, what: str) -> dict:
    """The hang finding once ``predicate`` holds for it; every finding seen meanwhile is kept."""
    seen: list[dict] = []

    def check() -> dict | None:
        now = findings(url)
        seen.extend(now)
        return next((f for f in now if f["finding"] == "hang" and predicate(f)), None)
    hang = wait_for(check, FIND_SECONDS, interval=0.5, what=what)
    hang["_seen"] = seen
    return hang


def diagnose(url: str) -> str:
    out = subprocess.run([sys.executable, "-m", "profagent", "diagnose", "--url", url], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "COLUMNS": "400"})
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.timeout(240)
def test_hung_dataloader_worker_is_named_with_its_pid_and_line(job, run_agent, tmp_path) -> None:
    j = job("worker_hang")
    url = start_agent(run_agent, tmp_path, j.proc.pid)
    truth = j.event(0, "worker_hang")
    line = f"{truth['file']}:{truth['line']}"
    # the worker is named as soon as it stands still; its rank is stalled once the worker has
    # stood still for stall_seconds (rank 1, waiting in backward, may stall first)
    hang = wait_hang(url, lambda f: f"PID {truth['pid']}" in f["summary"] and f["evidence"]["roles"]["0"]["stalled"],
                     "the hang naming the worker, its rank stalled")
    # rank 0 holds the job up, waiting for its worker; rank 1 waits in backward's all_reduce
    assert hang["rank"] == "0" and hang["evidence"]["culprit_ranks"] == ["0"], hang["summary"]
    assert line in hang["summary"] and f"DataLoader worker PID {truth['pid']}" in hang["summary"], hang["summary"]
    # the rank's own line, not a frame of the DataLoader's poll loop
    assert hang["evidence"]["roles"]["0"]["at"].startswith("main (failmodes.py:"), hang["evidence"]["roles"]
    assert "select" not in hang["summary"] and "selectmodule" not in hang["summary"], hang["summary"]
    workers = hang["evidence"]["dataloader_workers"]["0"]
    stuck = [w for w in workers if w["stuck"]]
    assert [w["pid"] for w in stuck] == [truth["pid"]] and stuck[0]["at"].endswith(f"({line})"), workers
    assert "DataLoader(timeout" in hang["advice"] and "more workers do not help" in hang["advice"]
    # no "more DataLoader workers" advice while the worker hangs: none beside the hang, over
    # several evaluations. Before, this small job's healthy phase waits for its DataLoader
    # about 30% of a step (the kernel probes measured 0.30), so a dataloader_bound then is
    # true, and may begin while the rank still eats the batches prefetched before the hang.
    first = json.loads(http_get(url + "/api/findings"))["evaluations"]

    def no_dataloader_bound() -> bool:
        body = json.loads(http_get(url + "/api/findings"))
        assert not [f for f in body["findings"] if f["finding"] == "dataloader_bound"], body["findings"]
        return body["evaluations"] >= first + 4
    wait_for(no_dataloader_bound, 30, interval=0.3, what="four more evaluations")
    # the location does not flip while the job stays hung
    again = wait_hang(url, lambda f: True, "the hang, later")
    assert again["evidence"]["roles"]["0"]["at"] == hang["evidence"]["roles"]["0"]["at"] and line in again["summary"]
    out = diagnose(url)
    assert "what to do" in out and "DataLoader(timeout" in out, out
    # rank 0 is stalled for every reader: the metric and top's state column
    stalled = {labels["rank"]: value for labels, value in
               parse_metrics(http_get(url + "/metrics")).get("profagent_rank_stalled", [])}
    assert stalled.get("0") == 1, stalled
    top = subprocess.run([sys.executable, "-m", "profagent", "top", "--url", url, "--once"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    row = next((x for x in top.stdout.splitlines() if x.split()[:1] == ["0"]), "")
    assert "STALLED" in row, top.stdout
    # the bundle holds every worker's stack, the hung one at its line
    summary = wait_for(lambda: next(iter((tmp_path / "state").rglob("summary.md")), None), 60, interval=0.5,
                       what="the incident bundle")
    bundle = summary.parent
    workers_files = sorted(bundle.glob("stacks-rank0-worker*.txt"))
    assert len(workers_files) >= 2, sorted(p.name for p in bundle.iterdir())
    hung_file = bundle / f"stacks-rank0-worker{truth['pid']}.txt"
    assert f"({line})" in hung_file.read_text(), hung_file.read_text()
    text = wait_for(lambda: (t := summary.read_text()) and "What to do" in t and t, 30, interval=0.5, what="summary")
    assert f"`SyntheticImages.__getitem__ ({line})`" in text, text


@pytest.mark.timeout(240)
def test_uneven_inputs_ending_in_barrier(job, run_agent, tmp_path) -> None:
    j = job("uneven")
    url = start_agent(run_agent, tmp_path, j.proc.pid)
    barrier, extra = j.event(0, "barrier"), j.event(1, "extra_batch")
    hang = wait_hang(url, lambda f: f["evidence"].get("diagnosis") == "uneven_inputs", "uneven inputs")
    summary = hang["summary"]
    assert summary.startswith("uneven inputs"), summary
    assert f"rank 0 waits in barrier at main ({barrier['file']}:{barrier['line']})" in summary, summary
    assert f"rank 1 at main ({extra['file']}:{extra['line']})" in summary, summary
    assert "DistributedSampler" in hang["advice"] and "join()" in hang["advice"]
    assert hang["evidence"]["diagnosis_ranks"] == {"finished": ["0"], "training": ["1"]}
    # never called a collective mismatch on the way
    assert not [f for f in hang["_seen"] if f["evidence"].get("diagnosis") == "collective_mismatch"], hang["_seen"]
    out = diagnose(url)
    assert "what to do" in out and "drop_last" in out, out


@pytest.mark.timeout(240)
def test_busy_culprit_spinning_at_one_line_is_stalled(job, run_agent, tmp_path) -> None:
    j = job("spin")
    url = start_agent(run_agent, tmp_path, j.proc.pid)
    truth = j.event(1, "spin")
    line = f"{truth['file']}:{truth['line']}"
    hang = wait_hang(url, lambda f: f["evidence"]["roles"].get("1", {}).get("stalled"), "the spinning rank stalled")
    assert hang["rank"] == "1" and hang["evidence"]["culprit_ranks"] == ["1"], hang["summary"]
    assert f"spin_forever ({line})" in hang["summary"], hang["summary"]
    assert "1" in hang["evidence"]["stalled_ranks"], hang["evidence"]
    assert hang["advice"] and "what to do" in diagnose(url)

"""Findings on real 2-rank torchrun/gloo CPU jobs, observed by a real `profagent attach`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.agent import free_port, http_get, parse_metrics
from helpers.paths import ROOT
from helpers.processes import kill_tree, wait_for

WORKLOAD = ROOT / "tests" / "workloads" / "train_ddp.py"
STALL_SECONDS = 10.0


def line_of(text: str) -> int:
    return next(i for i, line in enumerate(WORKLOAD.read_text().splitlines(), 1) if text in line)


class Torchrun:
    def __init__(self, tmp: Path, mode: str) -> None:
        self.log = tmp / f"torchrun-{mode}.log"
        self._out = self.log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
             str(WORKLOAD), mode], stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def wait_output(self, text: str, timeout: float = 120.0) -> float:
        wait_for(lambda: text in self.log.read_text(errors="replace"), timeout, what=f"{text!r} from the job")
        return time.monotonic()

    def stop(self) -> None:
        kill_tree(self.proc)
        self._out.close()


@pytest.fixture
def torchrun(tmp_path: Path):
    jobs: list[Torchrun] = []

    def start(mode: str) -> Torchrun:
        job = Torchrun(tmp_path, mode)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.stop()


def start_agent(run_agent, tmp_path: Path, pid: int, **findings: float):
    config = tmp_path / "profagent.toml"
    extra = "".join(f"{k} = {v}\n" for k, v in findings.items())
    config.write_text(f"[stacks]\nstall_seconds = {STALL_SECONDS}\nwindow = 2\nrate = 50\n"
                      f"[findings]\nwindow_seconds = 20\nmin_samples = 30\n{extra}"
                      "[ondemand]\nenabled = false\n"
                      # the stack- and trace-based findings under test (the kernel probes' own
                      # straggler, data wait and stall are in test_timeline_e2e)
                      "[timeline]\nenabled = false\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent = run_agent(["attach", "--pid", str(pid), "--listen", f"127.0.0.1:{port}", "--config", str(config),
                       "--gpu-backend", "off", "--interval", "0.5"])
    agent.wait_healthy(url, timeout=60)
    return agent, url


def findings(url: str) -> list[dict]:
    return json.loads(http_get(url + "/api/findings"))["findings"]


def wait_finding(url: str, kind: str, timeout: float, where=lambda f: True) -> dict:
    def found() -> dict | None:
        return next((f for f in findings(url) if f["finding"] == kind and where(f)), None)

    return wait_for(found, timeout, interval=0.5, what=f"finding {kind}")


def test_hang_names_rank_1_and_its_line_within_stall_seconds_plus_30(torchrun, run_agent, tmp_path) -> None:
    job = torchrun("hang")
    job.wait_output("rank 0 ready")
    _, url = start_agent(run_agent, tmp_path, job.proc.pid)
    hung_at = job.wait_output("rank 1 hangs")
    # Both ranks cross stall_seconds about together: a tick may first see rank 1 alone (its
    # finding then says "not in a collective"); the one that counts also sees rank 0 waiting.
    hang = wait_finding(url, "hang", timeout=STALL_SECONDS + 30 + 15,  # + the tick that publishes it
                        where=lambda f: f["evidence"].get("waiting_ranks"))
    elapsed = time.monotonic() - hung_at
    assert elapsed <= STALL_SECONDS + 30, f"hang named after {elapsed:.0f} s"
    line = f"train_ddp.py:{line_of('time.sleep(3600)')}"
    assert hang["rank"] == "1" and hang["severity"] == "critical", hang
    assert line in hang["summary"] and "all_reduce" in hang["summary"], hang["summary"]
    assert hang["evidence"]["waiting_ranks"] == ["0"]
    assert hang["evidence"]["called_at"].endswith(f"train_ddp.py:{line_of('dist.all_reduce(t)')})")

    # /metrics and /api/findings agree.
    active = {(s["finding"], s["rank"], s["severity"]) for s, v in parse_metrics(http_get(url + "/metrics"))
              .get("profagent_finding", []) if v == 1}
    assert active == {(f["finding"], f["rank"] or "", f["severity"]) for f in findings(url)}

    # And the diagnose command tells a person.
    out = subprocess.run([sys.executable, "-m", "profagent", "diagnose", "--url", url], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "CRITICAL hang" in out.stdout and "rank 1" in out.stdout and line in out.stdout, out.stdout
    as_json = json.loads(subprocess.run([sys.executable, "-m", "profagent", "diagnose", "--url", url, "--json"],
                                        capture_output=True, text=True, timeout=60).stdout)
    assert any(f["finding"] == "hang" and f["rank"] == "1" for f in as_json["findings"])


def test_straggler_is_the_rank_that_sleeps(torchrun, run_agent, tmp_path) -> None:
    job = torchrun("straggler")
    job.wait_output("rank 0 ready")
    _, url = start_agent(run_agent, tmp_path, job.proc.pid)
    f = wait_finding(url, "straggler", timeout=90)
    assert f["rank"] == "1", f
    assert f["evidence"]["others_median_collective_share"] > f["evidence"]["collective_share"] + 0.2
    assert not [x for x in findings(url) if x["finding"] == "straggler" and x["rank"] == "0"]


def test_slow_getitem_is_dataloader_bound(torchrun, run_agent, tmp_path) -> None:
    job = torchrun("slow_loader")
    job.wait_output("rank 0 ready")
    _, url = start_agent(run_agent, tmp_path, job.proc.pid)
    f = wait_finding(url, "dataloader_bound", timeout=90)
    assert f["evidence"]["share"] > 0.3 and f["rank"] in ("0", "1")


def test_fast_host_leak_has_rate_and_time_to_exhaustion(torchrun, run_agent, tmp_path) -> None:
    job = torchrun("leak")
    job.wait_output("rank 0 ready")
    # A short history and a horizon long enough that any leak on this node counts.
    _, url = start_agent(run_agent, tmp_path, job.proc.pid, leak_min_span_seconds=20,
                         leak_horizon_seconds=7 * 24 * 3600)  # the maximum allowed
    f = wait_finding(url, "memory_leak", timeout=120)
    assert f["rank"] == "0" and f["evidence"]["kind"] == "host", f
    rate = f["evidence"]["growth_bytes_per_second"]
    assert rate > 1 << 20, rate  # 2 MiB per step, dozens of steps per second minus the load
    assert f["evidence"]["seconds_to_exhaustion"] == pytest.approx(f["evidence"]["available_bytes"] / rate, rel=0.01)

"""The step timeline's test jobs: tests/workloads/timeline_job.py under torchrun (or
alone), an agent attached once every rank is probed, readers of what it exports, and the
check of its figures against a job's own log (``expected``, ``check_figures``)."""

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
from profagent.analysis.timeline import quantile

STAGES = ("data_wait", "backward", "optimizer")
WORKLOAD = ROOT / "tests" / "workloads" / "timeline_job.py"


class Job:
    def __init__(self, tmp: Path, ranks: int, *args: str, name: str = "job", env: dict[str, str] | None = None,
                 workload: Path = WORKLOAD) -> None:
        self.dir = tmp / name
        self.dir.mkdir()
        self.start_file = self.dir / "start"
        self.ranks = ranks
        self._out = (self.dir / "job.log").open("wb")
        script = [str(workload), "--truth-dir", str(self.dir), "--go-file", str(self.start_file), *args]
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                    "--master-port", str(free_port())] if ranks > 1 else [sys.executable]
        # one thread per process, as torchrun gives its ranks: a lone process would otherwise
        # run an OpenMP thread per core, spinning on the suite's 2 cores between its ops
        self.proc = subprocess.Popen([*launcher, *script], stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=WORKLOAD.parent,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})

    def truth(self, rank: int) -> dict:
        return json.loads((self.dir / f"rank{rank}.json").read_text())

    def done(self) -> bool:
        return all((self.dir / f"rank{r}.json").exists() for r in range(self.ranks))

    def stop(self) -> None:
        kill_tree(self.proc)
        self._out.close()


def metrics(url: str) -> dict:
    return parse_metrics(http_get(url + "/metrics"))


def value(m: dict, name: str, **labels: str) -> float | None:
    for got, v in m.get(name, []):
        if all(got.get(k) == want for k, want in labels.items()):
            return v
    return None


def attach(run_agent, job: Job, extra: list[str] | None = None, env: dict[str, str] | None = None) -> str:
    """An agent on the job, once every rank is probed (the job waits for its go file)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent = run_agent(["attach", "--pid", str(job.proc.pid), "--listen", f"127.0.0.1:{port}", "--gpu-backend", "off",
                       "--interval", "0.5", *(extra if extra is not None else ["--no-stacks"])],
                      env={"PROFAGENT_ONDEMAND_ENABLED": "false", **(env or {})})
    agent.wait_healthy(url, timeout=60)

    def probed() -> bool:
        m = metrics(url)
        placed = [v for _, v in m.get("profagent_timeline_probes", [])]
        seen = {labels["rank"] for labels, _ in m.get("profagent_optimizer_steps_total", [])}
        return bool(placed) and max(placed) >= 4 and seen == {str(r) for r in range(job.ranks)}

    wait_for(probed, 120, interval=0.5, what="probes on every rank")
    return url


def findings(url: str) -> dict:
    return json.loads(http_get(url + "/api/findings"))


def probes_placed(url: str) -> bool:
    return any(v >= 4 for _, v in metrics(url).get("profagent_timeline_probes", []))


def expected(truth: dict) -> tuple[list[float], dict[str, float]]:
    """Step intervals and stage shares from timeline_job.py's own log: the k-th interval
    holds the optimizer of step k and the data wait and backward of step k+1."""
    calls, stages = truth["calls"], truth["stages"]
    intervals = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    total = sum(intervals)
    shares = {
        "data_wait": sum(s["data_wait"] for s in stages[1:]) / total,
        "backward": sum(s["backward"] for s in stages[1:]) / total,
        "optimizer": sum(s["optimizer"] for s in stages[:-1]) / total,
    }
    return intervals, shares


def check_rank(m: dict, truth: dict, rank: int, shares: dict[str, float] | None = None) -> None:
    """timeline_job.py's log against the agent's figures (``shares``: the job's own, if
    given, else those ``expected`` reads)."""
    intervals, own = expected(truth)
    check_figures(m, intervals, own if shares is None else shares, rank)


def check_figures(m: dict, intervals: list[float], shares: dict[str, float], rank: int) -> None:
    """The agent's figures of one rank against the job's own: step count exact, p50 within
    2%, each stage's share within 2 points, and the four shares summing to the whole."""
    labels = {"rank": str(rank)}
    assert value(m, "profagent_step_seconds_count", **labels) == len(intervals)
    # the sum: a preemption between the job's clock and the probe at the first or last step
    # shifts it by that long (tens of ms on a loaded node), so 5%; the p50 below holds to 2%
    assert value(m, "profagent_step_seconds_sum", **labels) == pytest.approx(sum(intervals), rel=0.05)
    # p50 from the agent's window (every step here lies within it)
    p50 = value(m, "profagent_step_window_seconds", stat="p50", **labels)
    assert p50 == pytest.approx(quantile(intervals, 0.5), rel=0.02)
    total = value(m, "profagent_step_seconds_sum", **labels)
    got = {stage: value(m, "profagent_step_stage_seconds_total", stage=stage, **labels) / total
           for stage in (*STAGES, "other")}
    for stage in STAGES:
        assert got[stage] == pytest.approx(shares[stage], abs=0.02), (stage, got, shares)
    # the rest: within the three stages' tolerances together
    assert got["other"] == pytest.approx(1 - sum(shares.values()), abs=0.06), (got, shares)
    # time is counted once: a stage nested in another is not counted twice
    assert sum(got.values()) == pytest.approx(1.0, abs=0.01), got

"""The step timeline's test jobs: tests/workloads/timeline_job.py under torchrun (or
alone), an agent attached once every rank is probed, and readers of what it exports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.agent import free_port, http_get, parse_metrics
from helpers.paths import ROOT
from helpers.processes import kill_tree, wait_for

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

"""Two simulated nodes on one machine, for the cross-node tests (issue #39).

Each node is its own PID and mount namespace (``unshare -p -m -f --mount-proc``) with its
own ``profagent watch`` (its own config, state folder and TMPDIR, as real nodes have) and
its own torchrun launcher; the two launchers meet in a c10d rendezvous over loopback
(``--nnodes 2 --rdzv-id ID``). The job is tests/workloads/plain_ddp.py: each rank logs its
own ground truth (its rank, its pace, where it hangs) to ``node<N>/rank<R>.jsonl``. Which
node gets which ranks is the rendezvous' choice: tests ask the logs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from helpers.agent import free_port
from helpers.paths import ROOT
from helpers.plain_ddp import rank_events
from helpers.processes import kill_tree
from helpers.prometheus import Prometheus
from helpers.watch import token

WORKLOAD = ROOT / "tests" / "workloads" / "plain_ddp.py"
RULES = ROOT / "deploy" / "prometheus"


def agent_config(tmp: Path, node: int, tok: str, extra: str = "") -> Path:
    """The agent's config: no GPU, no on-demand endpoint, stacks and findings on short
    windows (``extra``: more TOML sections, e.g. scaled thresholds)."""
    path = tmp / f"node{node}.toml"
    path.write_text(
        f"interval = 0.5\nstate_dir = '{tmp / f'state{node}'}'\n"
        "[gpu]\nbackend = 'off'\n[ondemand]\nenabled = false\n"
        f"[watch]\ncmdline_regex = ''\nenv_markers = ['PAW_TOKEN={tok}']\ngpu_processes = false\nscan_interval = 0.3\n"
        + extra
    )
    return path


class Node:
    """One simulated node: a PID and mount namespace holding an agent and a torchrun launcher."""

    def __init__(self, tmp: Path, node: int, tok: str, job_id: str, rdzv_port: int, *, config: str,
                 mode: str = "healthy", nproc: int = 1, env: Mapping[str, str] | None = None) -> None:
        self.dir = tmp / f"node{node}"
        self.dir.mkdir()
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        agent = [sys.executable, "-m", "profagent", "watch", "--config", str(agent_config(tmp, node, tok, config)),
                 "--listen", self.address]
        torchrun = [sys.executable, str(Path(sys.executable).parent / "torchrun"), "--nnodes", "2",
                    "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", job_id, "--max-restarts", "0",
                    str(WORKLOAD), mode, "ddp"]
        script = self.dir / "node.sh"
        # torch's rendezvous tells nodes apart by host name and launcher PID: in fresh PID
        # namespaces on one host both launchers would get the same small PID, so node 1's
        # starts a few processes first (real nodes differ by name)
        script.write_text(f"for i in $(seq {1 + 4 * node}); do /bin/true; done\n"
                          + f"{_quote(agent)} > {self.dir}/agent.log 2>&1 &\n"
                          f"PAW_TOKEN={tok} {_quote(torchrun)} > {self.dir}/torchrun.log 2>&1 &\nwait\n")
        tmp_dir = self.dir / "tmp"  # each node its own /tmp, as real nodes have
        tmp_dir.mkdir()
        env = {**os.environ, "PLAIN_DDP_LOG": str(self.dir), "PLAIN_DDP_MAX_SECONDS": "300", "GLOO_SOCKET_IFNAME": "lo",
               "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_dir), **(env or {})}
        # the namespace's init is the shell: when it goes, the kernel kills everything inside
        self.proc = subprocess.Popen(["unshare", "-p", "-m", "-f", "--mount-proc", "bash", str(script)],
                                     env=env, start_new_session=True, cwd=WORKLOAD.parent)

    def ranks(self) -> list[int]:
        """The global ranks this node's launcher started (from their own logs)."""
        return sorted(int(p.stem[4:]) for p in self.dir.glob("rank*.jsonl"))

    def ready(self) -> int:
        """Ranks of this node that have built their model and begin stepping."""
        return sum(any(e["event"] == "ready" for e in self.events(r)) for r in self.ranks())

    def rank(self) -> int | None:
        found = self.ranks()
        return found[0] if found else None

    def events(self, rank: int | None = None) -> list[dict]:
        rank = self.rank() if rank is None else rank
        return rank_events(self.dir, rank) if rank is not None else []

    def log(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.dir.glob("*.log")))

    def stop(self) -> None:
        kill_tree(self.proc)


def _quote(argv: list[str]) -> str:
    return " ".join("'" + a.replace("'", "'\\''") + "'" for a in argv)


def start_two_nodes(tmp: Path, **node: object) -> tuple[str, list[Node]]:
    """(job id, [node 0, node 1]) of one torchrun job over two simulated nodes."""
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is needed to simulate two nodes")
    tok, job_id, rdzv = token(), f"twonode-{token()}", free_port()
    nodes: list[Node] = []
    try:
        for n in (0, 1):
            nodes.append(Node(tmp, n, tok, job_id, rdzv, **node))  # type: ignore[arg-type]
    except BaseException:
        for started in nodes:
            started.stop()
        raise
    return job_id, nodes


# The straggler and healthy scenarios: the defaults' minute-long windows scaled down (stack
# shares over 20 s from windows of 10 s at most, arrivals over 30 s, at least 20 s of them) so that a straggler is named
# within the two minutes on a loaded machine. Sampling rate and native windows at
# their defaults: py-spy pauses its rank at every sample, and faster or native sampling made a
# healthy rank arrive last at its node's collectives. Stalls at the default unless a scenario
# hangs (a busy rank never freezes, so a short stall time names no one before the hang).
def scaled(stall_seconds: float | None = None) -> str:
    """The scaled-down agent config (TOML sections for ``agent_config``'s ``extra``)."""
    stall = f"stall_seconds = {stall_seconds}\n" if stall_seconds is not None else ""
    return (f"[stacks]\nwindow = 2\nsteady_window = 10\n{stall}"
            "[findings]\nwindow_seconds = 20\nmin_samples = 30\narrival_min_seconds = 20\narrival_min_collectives = 20\n"
            "[timeline]\nwindow_seconds = 30\n")



@contextlib.contextmanager
def prometheus_over(nodes: list[Node], tmp: Path, on_failure: Callable[[Prometheus], None] | None = None,
                    ) -> Iterator[Prometheus]:
    """One real Prometheus scraping every node's agent with the shipped rules; on a failure
    each node's log (and ``on_failure``'s account) is printed. Prometheus stops either way."""
    prom = Prometheus([n.address for n in nodes], tmp, rule_files=[RULES / "alerts.yml", RULES / "recording.yml"])
    try:
        yield prom
    except BaseException:
        for n in nodes:
            print(n.log())
        if on_failure is not None:
            on_failure(prom)
        raise
    finally:
        prom.stop()

"""A DDP job over two simulated nodes: one answer for the job (issue #39).

Each node is its own PID and mount namespace (``unshare -p -m -f --mount-proc``), with its
own ``profagent watch`` and its own torchrun launcher; the two launchers meet in a c10d
rendezvous over loopback (``--nnodes 2 --rdzv-id ID``), one rank each. Which node gets
rank 1 is the rendezvous' choice: each rank logs its own ground truth (its rank, and the
file:line where rank 1 hangs: tests/workloads/plain_ddp.py, PLAIN_DDP_EVENT=hang:S).
One real Prometheus scrapes both agents and evaluates the shipped rules.

The answer must be the same everywhere: the job id from torchrun's command line on both
nodes from the first scrape (no PID id, no relabel), one ProfagentJobHang for the job
naming rank 1, its node and its line (while node 0's agent sees only rank 0 waiting), and
``diagnose --prometheus`` saying the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.agent import http_get
from helpers.nodes import Node, prometheus_over, start_two_nodes
from helpers.processes import wait_for
from helpers.prometheus import Prometheus

STALL_SECONDS = 10.0
HANG_STEP = 30
CONFIG = (f"[stacks]\nstall_seconds = {STALL_SECONDS}\nwindow = 2\nrate = 50\nnative_every_seconds = 10\n"
          "[findings]\nwindow_seconds = 20\nmin_samples = 30\n")
# like the privilege-dropping cases (tests/README.md): new PID namespaces need root
pytestmark = [pytest.mark.slow_first, pytest.mark.skipif(os.geteuid() != 0, reason="two simulated nodes need root for unshare -p -m")]


@pytest.fixture
def two_nodes(tmp_path: Path):
    job_id, nodes = start_two_nodes(tmp_path, config=CONFIG, env={"PLAIN_DDP_EVENT": f"hang:{HANG_STEP}"})
    yield job_id, nodes
    for node in nodes:
        node.stop()


@pytest.mark.slow
def test_a_hang_on_one_node_is_one_page_naming_rank_node_and_line(two_nodes, tmp_path: Path, request) -> None:
    job_id, nodes = two_nodes
    with prometheus_over(nodes, tmp_path) as prom:
        _check(prom, job_id, nodes)


def _check(prom: Prometheus, job_id: str, nodes: list[Node]) -> None:
    wait_for(lambda: all(n.rank() is not None for n in nodes), 120, interval=0.5, what="both ranks ready")
    culprit = next(n for n in nodes if n.rank() == 1)
    truth = wait_for(lambda: next((e for e in culprit.events() if e["event"] == "hang"), None), 120,
                     interval=0.5, what="rank 1 hangs")
    line = f"{truth['file']}:{truth['line']}"

    def verdict() -> dict | None:
        res = subprocess.run([sys.executable, "-m", "profagent", "diagnose", "--prometheus", prom.url, "--job", job_id,
                              "--json"], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        hangs = [f for f in json.loads(res.stdout)["findings"] if f["finding"] == "hang"]
        # node 1's agent names its rank at once; node 0's says its rank waits once it has seen
        # the rank's native frames (DDP's reducer): the job's answer holds both
        return hangs[0] if hangs and hangs[0]["culprit_ranks"] and len(hangs[0]["evidence"]["nodes"]) == 2 else None

    began = time.monotonic()
    hang = wait_for(verdict, STALL_SECONDS + 120, interval=2, what="diagnose --prometheus names the culprit")
    assert hang["culprit_ranks"] == ["1"] and hang["evidence"]["waiting_ranks"] == ["0"], hang
    [c] = hang["culprits"]
    assert c["instance"] == culprit.address and c["location"].endswith(line), (c, line)
    assert sorted(hang["evidence"]["nodes"]) == sorted(n.address for n in nodes), hang

    def page() -> dict | None:
        alerts = json.loads(http_get(prom.url + "/api/v1/alerts"))["data"]["alerts"]
        mine = [a for a in alerts if a["labels"]["alertname"] == "ProfagentJobHang" and a["labels"]["job_id"] == job_id]
        return mine if mine and "holds it up" in mine[0]["annotations"]["summary"] else None

    [alert] = wait_for(page, 30, interval=1, what="ProfagentJobHang naming the culprit")
    summary = alert["annotations"]["summary"]
    assert summary.startswith(f"Job {job_id} is hung: rank 1 on {culprit.address} at ") and summary.endswith(
        f"{line} holds it up"), summary
    assert time.monotonic() - began < STALL_SECONDS + 120

    # One job id on both nodes from the first scrape: torchrun's --rdzv-id, never a PID id.
    seen = prom.query(f"group by (job_id, instance) (last_over_time(profagent_target_up[{int(time.monotonic() - began) + 300}s]))")
    assert {(s["metric"]["job_id"], s["metric"]["instance"]) for s in seen} == {(job_id, n.address) for n in nodes}, seen
    for n in nodes:
        text = (n.dir / "agent.log").read_text()
        assert f"attached to job {job_id} " in text and " ended;" not in text and "is now job" not in text, text[-2000:]

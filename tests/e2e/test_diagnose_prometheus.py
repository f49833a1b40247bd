"""`profagent diagnose --prometheus` and ProfagentJobHang against a real Prometheus.

Two simulated nodes of one job (j2, ranks 0-1 on node 0, 2-3 on node 1) serve what their
agents export during a hang whose culprit, rank 3, sleeps at train_ddp.py:104: each
exposition is rendered by the agent's own code (the ``hang`` analyzer over each node's
stalled ranks, the findings and stacks families), and served over loopback. Node 0 sees
only ranks waiting in all_reduce; node 1 sees the culprit. A second job (j3) waits in a
collective on both nodes with no culprit anywhere. A real Prometheus scrapes both every
second and evaluates the shipped rules; the CLI and the (pending) alert must give one
answer per job.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from helpers.agent import http_get
from helpers.paths import ROOT
from helpers.processes import wait_for
from helpers.prometheus import Prometheus
from profagent.analysis.findings.hang import hang
from profagent.analysis.stacks import parse_frame
from profagent.contracts import FindingsSnapshot, RankStall, StacksSnapshot
from profagent.exporters.families import Families
from profagent.exporters.families import findings as findings_families
from profagent.exporters.families import stacks as stacks_families

MAIN = ("<module> (train_ddp.py:120)", "main (train_ddp.py:110)")
IN_ALL_REDUCE = (*MAIN, "wrapper (torch/distributed/c10d_logger.py:81)",
                 "all_reduce (torch/distributed/distributed_c10d.py:3252)")
ASLEEP = ("<module> (train_ddp.py:120)", "main (train_ddp.py:104)")
RULES = ROOT / "deploy" / "prometheus"


def _stall(job: str, rank: str, stack: tuple[str, ...]) -> RankStall:
    return RankStall(rank, True, 150.0, job, tuple(parse_frame(f) for f in stack))


def _exposition(stalls: list[RankStall]) -> bytes:
    """What one node's agent serves: the findings and stall families of its own ranks."""
    findings = [f for job in sorted({s.job_id for s in stalls}) for f in hang(stalls, job, settled=True)]
    families = Families()
    findings_families.render(FindingsSnapshot(tuple(findings), time.time()), families)
    stacks_families.render(StacksSnapshot("", (), tuple(stalls), ()), families)

    class Node:
        def collect(self):  # noqa: ANN202 (prometheus_client's collector protocol)
            return iter(families)

    registry = CollectorRegistry()
    registry.register(Node())
    return generate_latest(registry)


class _Serve(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args) -> None:  # noqa: ANN002
        pass


@pytest.fixture
def two_nodes():
    node0 = [_stall("j2", "0", IN_ALL_REDUCE), _stall("j2", "1", IN_ALL_REDUCE), _stall("j3", "0", IN_ALL_REDUCE)]
    node1 = [_stall("j2", "2", IN_ALL_REDUCE), _stall("j2", "3", ASLEEP), _stall("j3", "1", IN_ALL_REDUCE)]
    servers = []
    for stalls in (node0, node1):
        handler = type("Handler", (_Serve,), {"body": _exposition(stalls)})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    yield [f"127.0.0.1:{s.server_address[1]}" for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


def _diagnose(prom: Prometheus, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profagent", "diagnose", "--prometheus", prom.url, *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_one_verdict_per_job_across_nodes(two_nodes, tmp_path: Path) -> None:
    node0, node1 = two_nodes
    prom = Prometheus(two_nodes, tmp_path, rule_files=[RULES / "alerts.yml", RULES / "recording.yml"])
    try:
        wait_for(lambda: len(prom.query("profagent_hang_rank_info")) == 6, timeout=60, what="both nodes scraped")

        res = _diagnose(prom, "--json")
        assert res.returncode == 0, res.stderr
        body = json.loads(res.stdout)
        hangs = {f["job_id"]: f for f in body["findings"] if f["finding"] == "hang"}
        assert [f["finding"] for f in body["findings"]] == ["hang", "hang"]  # one per job, not one per node
        j2, j3 = hangs["j2"], hangs["j3"]
        assert j2["culprit_ranks"] == ["3"]
        assert j2["culprits"] == [{"rank": "3", "instance": node1, "location": "train_ddp.py:104"}]
        assert sorted(j2["evidence"]["nodes"]) == sorted([node0, node1])
        assert j3["culprit_ranks"] == [] and "no culprit seen on any node" in j3["summary"]

        res = _diagnose(prom, "--job", "j2")
        assert res.returncode == 0, res.stderr
        assert f"rank 3 on {node1} at train_ddp.py:104" in res.stdout and "j3" not in res.stdout

        # The page: one ProfagentJobHang per job (pending: its `for` is a minute), and its
        # summary already names what any node found. A summary is written at each evaluation
        # from what Prometheus holds then: one made before node 1's last scrape says no
        # culprit until the next evaluation (a second here), long before the page is sent.
        culprit = f"Job j2 is hung: rank 3 on {node1} at train_ddp.py:104 holds it up"

        def pending() -> dict[str, str]:
            alerts = json.loads(prom_get(prom, "/api/v1/alerts"))["data"]["alerts"]
            return {a["labels"]["job_id"]: a["annotations"]["summary"] for a in alerts if a["labels"]["alertname"] == "ProfagentJobHang"}

        summaries = wait_for(lambda: len(s := pending()) == 2 and s.get("j2") == culprit and s, timeout=30,
                             what="ProfagentJobHang pending for both jobs, naming j2's culprit")
        assert summaries["j3"] == "Job j3 is hung: no culprit seen on any node: a collective mismatch or the network"
        alerts = json.loads(prom_get(prom, "/api/v1/alerts"))["data"]["alerts"]
        assert not [a for a in alerts if a["labels"]["alertname"] == "ProfagentFindingCritical"]
    finally:
        prom.stop()


def prom_get(prom: Prometheus, path: str) -> str:
    return http_get(prom.url + path)


def test_bad_prometheus_is_one_line_and_exit_2(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "profagent", "diagnose", "--prometheus", "http://127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.count("\n") == 1 and "cannot reach Prometheus at http://127.0.0.1:1" in res.stderr
    res = subprocess.run([sys.executable, "-m", "profagent", "diagnose", "--prometheus", "http://x:1", "--url", "http://y:2"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "give one of --pid, --url and --prometheus" in res.stderr

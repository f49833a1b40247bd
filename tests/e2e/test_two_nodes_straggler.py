"""A straggler over two simulated nodes (issue #39; tests/helpers/nodes.py): a real
torchrun DDP job of two ranks per node, global rank 2 doing three times the others' work
each step (tests/workloads/plain_ddp.py logs each rank's work and pace). One real
Prometheus scrapes both agents and evaluates the shipped rules.

Within two minutes of the ranks' start, the job-level straggler series
(instance_job_id_rank:profagent_collective_wait_ratio:job_straggler) and the agent of rank
2's node both name rank 2, and then they hold: sampled every second for half a minute,
and counted by Prometheus over the same time, with no evaluation or scrape without them.
No other rank is named, on either node, and no other finding is raised.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from helpers.agent import http_get
from helpers.nodes import SCALED, Node, prometheus_over, start_two_nodes
from helpers.processes import wait_for
from helpers.prometheus import Prometheus

SLOW_RANK = 2
NAMED_WITHIN = 120.0  # the issue's two minutes, from the ranks' start
HOLD = 30  # seconds sampled after both name it
SERIES = "instance_job_id_rank:profagent_collective_wait_ratio:job_straggler"
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="two simulated nodes need root for unshare -p -m")


@pytest.mark.slow
@pytest.mark.slow_first
@pytest.mark.timeout(330)  # up to 2 min of start-up on a loaded node, 2 min to name, 30 s of hold
def test_a_straggler_on_node_1_is_named_by_the_job_rule_and_its_agent_and_holds(tmp_path: Path) -> None:
    job_id, nodes = start_two_nodes(tmp_path, config=SCALED, mode="straggler", nproc=2,
                                    env={"PLAIN_DDP_SLOW_RANK": str(SLOW_RANK)})
    try:
        with prometheus_over(nodes, tmp_path, on_failure=lambda prom: _print_state(prom, job_id, nodes)) as prom:
            _check(prom, job_id, nodes)
    finally:
        for n in nodes:
            n.stop()


def _check(prom: Prometheus, job_id: str, nodes: list[Node]) -> None:
    started = time.monotonic()
    wait_for(lambda: all(n.ready() == 2 for n in nodes), 120, interval=0.5, what="four ranks ready")
    began = time.monotonic()
    slow = next(n for n in nodes if SLOW_RANK in n.ranks())
    # ground truth from the ranks themselves: rank 2 does three times the others' work
    work = {r: next(e["repeat"] for e in n.events(r) if e["event"] == "ready") for n in nodes for r in n.ranks()}
    assert work[SLOW_RANK] == 3 * min(work.values()) and sorted(work.values())[:3] == [min(work.values())] * 3, work

    def series() -> list[tuple[str, str]]:
        return [(s["metric"]["instance"], s["metric"]["rank"]) for s in prom.query(f'{SERIES}{{job_id="{job_id}"}}')]

    def stragglers(node: Node) -> list[dict]:
        answer = json.loads(http_get(node.url + "/api/findings"))
        return [f for f in answer["findings"] if f["finding"] == "straggler" and f["job_id"] == job_id]

    want = [(slow.address, str(SLOW_RANK))]
    wait_for(lambda: series() == want, NAMED_WITHIN, interval=1, what="the job-level straggler series naming rank 2")
    rule_at = time.monotonic() - began
    [finding] = wait_for(lambda: stragglers(slow), max(1.0, NAMED_WITHIN - rule_at), interval=1,
                         what="rank 2's agent naming its straggler")
    agent_at = time.monotonic() - began
    assert finding["rank"] == str(SLOW_RANK), finding
    assert "contended" not in finding["summary"], finding  # its own extra work, not the node
    print(f"ranks ready at +{began - started:.0f} s; named by the rule at +{rule_at:.0f} s, by the agent at +{agent_at:.0f} s: {finding['summary']}")

    # They hold: every second for HOLD seconds, and at every evaluation and scrape in between.
    held_from = time.monotonic()
    gaps = []
    while time.monotonic() - held_from < HOLD:
        got = (series(), [f["rank"] for f in stragglers(slow)], [f["rank"] for f in stragglers(_other(nodes, slow))])
        if got != (want, [str(SLOW_RANK)], []):  # with what gates the rule and the finding, to say why
            gates = prom.query(f'{{__name__=~"profagent_rank_stack_unchanged_seconds|profagent_rank_stalled|'
                               f'profagent_finding", job_id="{job_id}"}}')
            gaps.append((round(time.monotonic() - began), got,
                         [(g["metric"]["__name__"], g["metric"].get("finding"), g["metric"]["rank"], g["value"][1])
                          for g in gates if g["value"][1] != "0"]))
        time.sleep(1)
    assert not gaps, gaps
    span = f"{int(time.monotonic() - held_from)}s"
    rule_count = _count(prom, f'count_over_time({SERIES}{{job_id="{job_id}"}}[{span}])')
    evaluations = _count(prom, f'count_over_time(job_id:profagent_target_up:nodes{{job_id="{job_id}"}}[{span}])')
    scrapes = _count(prom, f'sum_over_time(up{{instance="{slow.address}"}}[{span}])')  # the ones that answered
    finding_count = _count(prom, f'count_over_time(profagent_finding{{job_id="{job_id}", finding="straggler", '
                                 f'rank="{SLOW_RANK}", instance="{slow.address}"}}[{span}])')
    assert evaluations >= HOLD / 2 and rule_count >= evaluations, (rule_count, evaluations)
    assert scrapes >= HOLD / 2 and finding_count == scrapes, (finding_count, scrapes)

    # Over the whole run: no other rank named, no other finding, on either node.
    run = f"{int(time.monotonic() - began) + 60}s"
    named = prom.query(f'group by (instance, rank) (last_over_time({SERIES}{{job_id="{job_id}"}}[{run}]))')
    assert [(s["metric"]["instance"], s["metric"]["rank"]) for s in named] == want, named
    raised = prom.query(f'group by (instance, rank, finding) (last_over_time(profagent_finding{{job_id="{job_id}"}}[{run}]))')
    assert [(s["metric"]["instance"], s["metric"]["rank"], s["metric"]["finding"]) for s in raised] == [
        (slow.address, str(SLOW_RANK), "straggler")], raised


def _other(nodes: list[Node], node: Node) -> Node:
    return next(n for n in nodes if n is not node)


def _count(prom: Prometheus, expr: str) -> float:
    found = prom.query(expr)
    assert len(found) <= 1, found
    return float(found[0]["value"][1]) if found else 0.0


def _print_state(prom: Prometheus, job_id: str, nodes: list[Node]) -> None:
    """What the rule and the agents saw at the end: each rank's wait share and the rule's steps."""
    for expr in ("profagent_collective_wait_ratio", "instance_job_id_rank:profagent_collective_wait_ratio:straggling",
                 "max_over_time(instance_job_id_rank:profagent_collective_wait_ratio:straggling[5m])",
                 "count_over_time(instance_job_id_rank:profagent_collective_wait_ratio:straggling[5m])", SERIES,
                 "profagent_finding"):
        try:
            found = prom.query(f'{expr}{{job_id="{job_id}"}}' if "(" not in expr else expr)
            print(expr, [(r["metric"].get("rank"), r["metric"].get("finding"), r["value"][1]) for r in found])
        except Exception as exc:  # the state is a help, never the failure
            print(expr, exc)
    for n in nodes:
        try:
            print(n.address, [(f["finding"], f["rank"], f["summary"]) for f in
                              json.loads(http_get(n.url + "/api/findings"))["findings"]])
        except Exception as exc:
            print(n.address, exc)

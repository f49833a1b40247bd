"""Probe events lost per rank (issue 51, Medium): a ring's lost record says neither whose
events it dropped nor when, so its count goes to the observed ranks whose samples that
ring held in the same read, or when it held none of theirs to every rank with a recent
event (never an idle one: another process's flood says nothing of it); the rank's
figures then say they miss events (/metrics, /api, ``diagnose``, ``top``)."""

from __future__ import annotations

import io
import os
import struct

from rich.console import Console
from test_perfevents_ring import lost, ring_with, sample

import profagent.cli.diagnose as diagnose
import profagent.cli.top as top
from profagent.config import TimelineConfig
from profagent.exporters.api.findings import step_row
from profagent.sources.timeline.source import LOSS_ACTIVE, TimelineSource, _Rank
from profagent.system import perfevents


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def _reader(records: list[bytes]) -> perfevents.TracepointReader:
    reader = perfevents.TracepointReader(pages=1, cpus=[0])
    ring = ring_with(records, 0)[0]
    ring.fd, writer = os.pipe()  # an fd that poll(2) takes (hung up: no wait); read() then drains the ring
    os.close(writer)
    reader.rings[0] = ring
    return reader


def test_a_rings_loss_goes_to_the_ranks_that_ran_there_else_to_every_rank() -> None:
    clock = Clock()
    source = TimelineSource(TimelineConfig(), interval=0.5, clock=clock)
    source._ranks = {40: _Rank("a", "0"), 41: _Rank("a", "1"), 99: _Rank("b", "0")}
    body = struct.pack("<Q", 0) + b"x" * 16
    reader = _reader([sample(1, 40, 40, 7, body), lost(12), sample(2, 41, 41, 7, body), sample(3, 5, 5, 7, body)])
    reader.read(0)
    assert reader.lost == [12] and reader.losses == [(12, frozenset({40, 41, 5}))]
    source._attribute_losses(reader)
    assert [source._ranks[p].lost_events for p in (40, 41, 99)] == [12, 12, 0]  # job b never ran there
    assert reader.losses == []

    # a ring that held nothing but the loss: the ranks with an event in the last seconds
    # (one whose events were all lost), never an idle one
    clock.t = 100.0
    source._ranks[99].timeline.last_event = 99.0
    source._ranks[41].timeline.last_event = 100.0 - LOSS_ACTIVE - 0.1
    reader = _reader([lost(3)])
    reader.read(0)
    source._attribute_losses(reader)
    assert [source._ranks[p].lost_events for p in (40, 41, 99)] == [12, 12, 3]
    steps = source._rank_steps(40, source._ranks[40], now=0.0)
    assert steps.lost_events == 12 and step_row(steps)["lost_events"] == 12


def test_diagnose_and_top_say_the_figures_miss_events() -> None:
    row = {"job_id": "a", "rank": "0", "p50_seconds": 0.1, "p90_seconds": 0.2, "stage_shares": {},
           "steps_per_second": 10.0, "lost_events": 15}
    out = io.StringIO()
    diagnose._render_steps([row, {**row, "rank": "1", "lost_events": 0}], Console(file=out, width=200))
    lines = out.getvalue().splitlines()
    assert "rank 0: p50 100.0 ms" in lines[1] and "misses events (15 lost: figures approximate, counts a floor)" in lines[1]
    assert "rank 1" in lines[2] and "misses" not in lines[2]
    [job] = top.read({"jobs": [{"ranks": [{"rank": "0", "timeline": {"lost_events": 15}}, {"rank": "1", "timeline": None}]}]}).jobs
    assert [r.lost_events for r in job.ranks] == [15, 0]

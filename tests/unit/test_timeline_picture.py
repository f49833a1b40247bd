"""The step timeline's picture (analysis/timeline_picture.py) from probe events fed to
RankTimeline as the source feeds them: the Trace Event Format's documented fields
(helpers/chrome_trace.py), each rank's spans against the steps fed, a straggler's lag as
the others' wait, where each rank of a hung job stopped, one clock across nodes, the
history's JSON read back strictly, and the history's size bounded."""

from __future__ import annotations

import json
import tracemalloc
from collections import deque

import pytest

from helpers import chrome_trace
from profagent.analysis import timeline as tl
from profagent.analysis.timeline_picture import (
    BadHistory,
    history_from_json,
    history_json,
    rank_history,
)
from profagent.analysis.timeline_picture import chrome_trace as picture
from profagent.contracts import TimelineHistory

STEP = 0.1  # seconds
LATE = 0.02  # the straggler's extra compute before its collectives


def feed_step(t: tl.RankTimeline, x: float, late: float = 0.0, collectives: int = 2) -> None:
    """One step from x: optimizer step and zero_grad, data wait, forward, a backward that
    calls ``collectives`` collectives (``late`` seconds later on a straggler)."""
    t.feed(tl.STEP, 1, x)
    t.feed(tl.RECORD_EXIT, 1, x + 0.001)
    t.feed(tl.ZERO_GRAD, 1, x + 0.002)
    t.feed(tl.RECORD_EXIT, 1, x + 0.003)
    t.feed(tl.DATA, 1, x + 0.004)
    t.feed(tl.RECORD_EXIT, 1, x + 0.010)
    t.feed(tl.BACKWARD, 1, x + 0.040)
    for k in range(collectives):
        t.feed(tl.COLLECTIVE, 1, x + 0.050 + late + 0.005 * k)
    t.feed(tl.BACKWARD_END, 1, x + 0.095)


def job(steps: int, straggler_late: float = 0.0, offsets: tuple[float, float] = (0.0, 0.0)) -> list[tl.RankTimeline]:
    ranks = [tl.RankTimeline(), tl.RankTimeline()]
    for i in range(steps):
        for r, t in enumerate(ranks):
            feed_step(t, offsets[r] + i * STEP, late=straggler_late if r == 1 else 0.0)
    return ranks


def history(ranks: list[tl.RankTimeline], now: float, node: str = "n0", offset: float = 1.7e9,
            names: tuple[str, ...] = ("0", "1"), seconds: float = 60.0) -> TimelineHistory:
    return TimelineHistory(node, now, offset, tuple(
        rank_history(t, "j", name, 100 + i, node, now, now - seconds) for i, (name, t) in enumerate(zip(names, ranks, strict=True))))


def test_the_picture_holds_the_format_and_each_rank_s_steps_and_stages() -> None:
    ranks = job(11)
    doc = picture([history(ranks, now=1.1)])
    assert chrome_trace.check(doc) == []
    json.dumps(doc)  # plain JSON
    assert set(chrome_trace.tracks(doc)) == {"rank 0 (PID 100)", "rank 1 (PID 101)"}
    origin = doc["otherData"]["origin_unix_seconds"]
    for rank in ("0", "1"):
        track = chrome_trace.rank_track(doc, rank)
        steps = [e for e in chrome_trace.events(doc, track, "X", "step") if "under way" not in e["name"]]
        assert [e["args"]["step"] for e in steps] == list(range(1, 11))
        for i, e in enumerate(steps):
            assert e["ts"] / 1e6 + origin == pytest.approx(1.7e9 + i * STEP, abs=1e-6)
            assert e["dur"] == pytest.approx(STEP * 1e6, abs=0.01)
            assert e["args"]["micro_batches"] == 1 and e["args"]["collectives"] == 2
        stages = chrome_trace.events(doc, track, "X", "stage")
        first = [(e["name"], round(e["dur"] / 1e3, 3)) for e in stages if e["args"]["step"] == 1]
        # the step from one optimizer call to the next: optimizer, zero_grad, data, forward, backward
        assert first == [("optimizer", 1.0), ("forward/other", 1.0), ("optimizer", 1.0), ("forward/other", 1.0),
                         ("data wait", 6.0), ("forward/other", 30.0), ("backward", 55.0), ("forward/other", 5.0)]
        # the stage slices tile each step: the stage figures add up to the step
        for e in steps:
            inside = [s["dur"] for s in stages if s["args"]["step"] == e["args"]["step"]]
            assert sum(inside) == pytest.approx(e["dur"], abs=0.05)


def test_a_straggler_s_lag_is_the_other_rank_s_wait() -> None:
    ranks = job(11, straggler_late=LATE)
    doc = picture([history(ranks, now=1.1)])
    assert chrome_trace.check(doc) == []
    calls = {r: [e for e in chrome_trace.events(doc, chrome_trace.rank_track(doc, r), "i", "collective")
                 if e["args"]["step"] <= 10] for r in ("0", "1")}
    assert len(calls["0"]) == len(calls["1"]) == 20
    for fast, slow in zip(calls["0"], calls["1"], strict=True):
        assert slow["args"]["lag_ms"] == pytest.approx(LATE * 1e3, abs=1e-3)
        assert fast["args"]["lag_ms"] == 0
        assert fast["args"]["wait_for_last_ms"] == pytest.approx(LATE * 1e3, abs=1e-3)
        assert slow["args"]["wait_for_last_ms"] == 0
    steps0 = chrome_trace.events(doc, chrome_trace.rank_track(doc, "0"), "X", "step")
    assert all(e["args"]["collective_wait_ms"] == pytest.approx(2 * LATE * 1e3, abs=1e-3)
               for e in steps0 if e["args"]["step"] <= 10)


def test_a_hang_shows_where_each_rank_stopped() -> None:
    """Rank 1 stops for good in its forward as its 7th step begins; rank 0 goes on
    into its backward, calls the first collective and waits there."""
    ranks = job(6)
    r0, r1 = ranks
    x = 6 * STEP
    for t in ranks:
        t.feed(tl.STEP, 1, x)
        t.feed(tl.RECORD_EXIT, 1, x + 0.001)
        t.feed(tl.DATA, 1, x + 0.004)
        t.feed(tl.RECORD_EXIT, 1, x + 0.010)
    r0.feed(tl.BACKWARD, 1, x + 0.040)
    r0.feed(tl.COLLECTIVE, 1, x + 0.050)
    now = x + 30.0
    doc = picture([history(ranks, now=now)])
    assert chrome_trace.check(doc) == []
    under_way = {}
    for rank in ("0", "1"):
        track = chrome_trace.rank_track(doc, rank)
        [step] = [e for e in chrome_trace.events(doc, track, "X", "step") if "under way" in e["name"]]
        assert step["args"]["step"] == 7 and step["dur"] == pytest.approx(30.0e6, abs=1)
        under_way[rank] = step["args"]["now_in"]
        [last] = [e for e in chrome_trace.events(doc, track, "i") if e["name"] == "last probe event"]
        assert last["args"]["seconds_before_now"] == pytest.approx(30.0 - (0.05 if rank == "0" else 0.01), abs=1e-6)
    assert under_way == {"0": "backward", "1": "forward/other"}
    # rank 0's open backward runs to now; the one collective it called is drawn
    track0 = chrome_trace.rank_track(doc, "0")
    [open_block] = [e for e in chrome_trace.events(doc, track0, "X", "stage") if e["args"].get("open")]
    assert open_block["name"] == "backward" and open_block["dur"] == pytest.approx((30.0 - 0.040) * 1e6, abs=1)
    assert [e["args"]["step"] for e in chrome_trace.events(doc, track0, "i", "collective")][-1] == 7
    assert not [e for e in chrome_trace.events(doc, chrome_trace.rank_track(doc, "1"), "i", "collective")
                if e["args"]["step"] == 7]


def test_two_nodes_share_one_clock() -> None:
    """Each node's probe clock is its own: node 1's monotonic clock reads 500 s more than
    node 0's at the same instant. With each agent's offset to Unix time, the same step of
    both ranks starts at the same time in the picture, on two processes (nodes)."""
    a, b = job(11)
    node0 = history([a], now=1.1, node="n0", offset=1.7e9, names=("0",))
    b2 = tl.RankTimeline()
    for i in range(11):
        feed_step(b2, 500.0 + i * STEP, late=LATE)
    node1 = history([b2], now=501.1, node="n1", offset=1.7e9 - 500.0, names=("1",))
    doc = picture([node1, node0])
    assert chrome_trace.check(doc) == []
    assert sorted(chrome_trace.processes(doc).values()) == ["n0 · job j", "n1 · job j"]
    t0, t1 = chrome_trace.rank_track(doc, "0"), chrome_trace.rank_track(doc, "1")
    assert t0[0] != t1[0]
    s0 = [e["ts"] for e in chrome_trace.events(doc, t0, "X", "step")]
    s1 = [e["ts"] for e in chrome_trace.events(doc, t1, "X", "step")]
    assert s0 == pytest.approx(s1, abs=0.01)
    lags = [e["args"]["lag_ms"] for e in chrome_trace.events(doc, t1, "i", "collective") if e["args"]["step"] <= 10]
    assert lags == pytest.approx([LATE * 1e3] * 20, abs=1e-3)  # matched across the nodes


def test_the_history_reads_back_from_json_and_refuses_anything_else() -> None:
    ranks = job(5, straggler_late=LATE)
    h = history(ranks, now=0.5)
    back = history_from_json(json.loads(json.dumps(history_json(h))))
    assert back == h
    assert picture([back]) == picture([h])
    good = history_json(h)
    for broken in ({"ranks": "x"}, {**good, "now": "1"}, {**good, "ranks": [{"steps": [{"number": True}]}]},
                   {**good, "ranks": [{**good["ranks"][0], "steps": [{**good["ranks"][0]["steps"][0],
                                                                        "spans": [["evil", 0, 1]]}]}]},
                   {**good, "clock_offset": float("nan")}, [], None):
        with pytest.raises(BadHistory):
            history_from_json(broken)


def test_the_window_and_the_history_are_bounded() -> None:
    t = tl.RankTimeline(history=deque(maxlen=100))
    for i in range(1000):
        feed_step(t, i * STEP)
    assert len(t.history) == 100 and t.history[-1].number == 999
    h = rank_history(t, "j", "0", 1, "n", 100.0, 100.0 - 2.0)
    assert [s.number for s in h.steps] == list(range(980, 1000))  # the steps of the last 2 s
    # stage blocks per step are capped: a job opening thousands cannot grow a step
    t.feed(tl.STEP, 1, 200.0)
    t.feed(tl.RECORD_EXIT, 1, 200.00005)
    for k in range(3 * tl.MAX_SPANS):
        t.feed(tl.DATA, 1, 200.0 + k * 1e-4)
        t.feed(tl.RECORD_EXIT, 1, 200.0 + k * 1e-4 + 5e-5)
    t.feed(tl.STEP, 1, 201.0)
    assert len(t.history[-1].spans) == tl.MAX_SPANS
    # memory: the default history of a DDP step like these holds under 1.5 KB a step
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        full = tl.RankTimeline()
        for i in range(tl.HISTORY_STEPS + 100):
            feed_step(full, i * STEP, collectives=4)
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(full.history) == tl.HISTORY_STEPS
    assert used / tl.HISTORY_STEPS < 1536, used


def test_a_step_skewed_past_half_a_step_is_matched_with_the_same_step_of_the_other_rank() -> None:
    """Rank 1 runs its 5th step early and long (its optimizer call at 0.43 s, the next at
    0.54 s, while rank 0's are at 0.5 and 0.6): rank 1's 6th step starts nearest rank 0's
    5th. Each collective is still paired with the same step's on the other rank: rank 0's
    wait is rank 1's lag, and the other way round, at every step."""
    from profagent.contracts import PicturedStep, RankHistory

    def rank(starts: list[float], call_after: float) -> tuple[PicturedStep, ...]:
        return tuple(PicturedStep(n, a, b - a, {}, 1, (a + call_after,), ())
                     for n, (a, b) in enumerate(zip(starts, starts[1:], strict=False), start=1))

    even = [0.1 * i for i in range(12)]
    skewed = [*even[:5], 0.43, 0.54, *even[7:]]
    h = TimelineHistory("n", 2.0, 0.0, (RankHistory("j", "0", 1, "n", rank(even[1:], 0.02)),
                                          RankHistory("j", "1", 2, "n", rank(skewed[1:], 0.03))))
    doc = picture([h])
    assert chrome_trace.check(doc) == []
    calls = {r: {e["args"]["step"]: e["args"] for e in chrome_trace.events(doc, chrome_trace.rank_track(doc, r), "i")
                 if e.get("cat") == "collective"} for r in ("0", "1")}
    assert set(calls["0"]) == set(calls["1"]) == set(range(1, 11))
    for n in range(1, 11):
        assert calls["0"][n]["wait_for_last_ms"] == calls["1"][n]["lag_ms"], n
        assert calls["1"][n]["wait_for_last_ms"] == calls["0"][n]["lag_ms"], n
    assert calls["0"][5]["lag_ms"] == pytest.approx(0.52 * 1e3 - 0.46 * 1e3, abs=1e-3)


def test_agents_that_name_their_node_alike_get_a_process_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two agents on hosts named alike (containers; two agents of one test host): each
    node's name gets its agent's address, so each has its own process in the picture."""
    from profagent.cli import picture as cli_picture

    a, b = job(3)
    answers = {"http://10.0.0.1:19400": history([a], now=0.3, node="worker", names=("0",)),
               "http://10.0.0.2:19400": history([b], now=0.3, node="worker", names=("1",)),
               "http://10.0.0.3:19400": history([], now=0.3, node="other", names=())}
    monkeypatch.setattr(cli_picture, "from_agent", lambda url, *_: answers[url])
    merged = cli_picture.from_agents(list(answers), 60.0, [], "j")
    assert [h.node for h in merged] == ["worker (10.0.0.1:19400)", "worker (10.0.0.2:19400)", "other"]
    assert [r.node for h in merged for r in h.ranks] == ["worker (10.0.0.1:19400)", "worker (10.0.0.2:19400)"]
    assert sorted(chrome_trace.processes(picture(merged)).values()) == [
        "worker (10.0.0.1:19400) · job j", "worker (10.0.0.2:19400) · job j"]

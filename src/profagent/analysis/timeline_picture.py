"""The step timeline as a picture: Chrome's trace event format, which Perfetto UI and
chrome://tracing open (pure: histories in, a JSON-ready dict out).

One process per node and job, one thread (track) per rank, in rank order. Each step is a
slice ``step N``; inside it, its stage blocks (data wait, backward, optimizer) and the
gaps between them (forward/other) as slices; each collective call as an instant whose
args give its lag behind the first rank and how long the rank then waited for the last
one. The step under way is drawn up to the history's ``now``, with the blocks still open:
where a rank that hangs stopped. Each node's probe clock is put on Unix time with its
agent's offset (``TimelineHistory.clock_offset``), so the waits line up across nodes.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from profagent.analysis import timeline as tl
from profagent.contracts import PicturedStep, RankHistory, TimelineHistory

STAGE_NAMES = {"data_wait": "data wait", "backward": "backward", "optimizer": "optimizer", "other": "forward/other"}
MIN_GAP = 1e-6  # seconds: a forward/other gap shorter than a microsecond is not drawn


def rank_history(t: tl.RankTimeline, job_id: str, rank: str, pid: int, node: str, now: float, since: float) -> RankHistory:
    """A rank's steps that ended at or after ``since`` and the step it is in at ``now``."""
    return history_of(recent_pictured(t, since), t.in_progress(), t.steps_total, t.last_event, job_id, rank, pid, node, now)


def recent_pictured(t: tl.RankTimeline, since: float) -> list[tl.Pictured]:
    """The rank's kept steps that ended at or after ``since``, oldest first (a quick copy:
    the source takes it under its lock, and builds the history after)."""
    out = []
    for pictured in reversed(t.history):  # newest first: stop at the first one too old
        if pictured.step.start + pictured.step.seconds < since:
            break
        out.append(pictured)
    out.reverse()
    return out


def history_of(pictured: list[tl.Pictured], now_in: tl.InProgress, steps_total: int, last_event: float | None,
               job_id: str, rank: str, pid: int, node: str, now: float) -> RankHistory:
    steps = tuple(PicturedStep(p.number, p.step.start, p.step.seconds, dict(p.step.stages), p.step.backwards,
                               p.step.arrivals, p.spans) for p in pictured)
    current = None
    if now_in.start is not None:
        current = PicturedStep(steps_total + 1, now_in.start, max(0.0, now - now_in.start), {}, now_in.backwards,
                               now_in.arrivals, now_in.spans)
    return RankHistory(job_id, rank, pid, node, steps, current, now_in.open_blocks, last_event)


def chrome_trace(histories: Sequence[TimelineHistory], seconds: float | None = None) -> dict[str, Any]:
    """The picture of ``histories`` (one a node), each on its own clock: each node's times
    are put on Unix time with its ``clock_offset``, so the waits line up across nodes."""
    ranks = sorted(((r, h.clock_offset) for h in histories for r in h.ranks),
                   key=lambda ro: (ro[0].job_id, _rank_order(ro[0].rank), ro[0].node, ro[0].pid))
    now = max((h.now + h.clock_offset for h in histories), default=0.0)
    lags = _lags(ranks)
    # ts counts microseconds from a whole Unix second before the first step: a time is
    # moved by (offset - origin), small, so a step's microseconds keep their nanoseconds
    origin = float(int(min((s.start + offset for r, offset in ranks
                            for s in (*r.steps, *((r.current,) if r.current else ()))), default=now)))
    events: list[dict[str, Any]] = []
    processes: dict[tuple[str, str], int] = {}
    for tid, (r, offset) in enumerate(ranks, start=1):
        shift = offset - origin
        pid = processes.get((r.node, r.job_id))
        if pid is None:
            pid = processes[(r.node, r.job_id)] = len(processes) + 1
            name = f"{r.node or 'node'} · job {r.job_id}" if r.job_id else (r.node or "node")
            events.append(_meta("process_name", pid, 0, {"name": name}))
            events.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
        events.append(_meta("thread_name", pid, tid, {"name": f"rank {r.rank} (PID {r.pid})"}))
        events.append(_meta("thread_sort_index", pid, tid, {"sort_index": tid}))
        for step in r.steps:
            events.extend(_step(step, pid, tid, lags.get((r.job_id, r.rank, step.start + offset), {}), shift, done=True))
        if r.current is not None:
            events.extend(_step(r.current, pid, tid, lags.get((r.job_id, r.rank, r.current.start + offset), {}), shift,
                                done=False, open_stages=r.open_stages))
        if r.last_event is not None:
            events.append({"name": "last probe event", "ph": "i", "s": "t", "ts": _us(r.last_event, shift), "pid": pid,
                           "tid": tid, "cat": "rank", "args": {"seconds_before_now": round(now - r.last_event - offset, 6)}})
    other: dict[str, Any] = {"clock": "ts: microseconds since Unix time origin_unix_seconds (each node's probe clock "
                                      "plus its agent's offset to Unix time)",
                             "origin_unix_seconds": origin, "now_unix_seconds": now,
                             "nodes": sorted({h.node for h in histories}), "ranks": len(ranks)}
    if seconds is not None:
        other["seconds"] = seconds
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _step(step: PicturedStep, pid: int, tid: int, lags: Mapping[int, tuple[float, float]], shift: float, done: bool,
          open_stages: Sequence[tuple[str, float]] = ()) -> list[dict[str, Any]]:
    start, end = step.start, step.start + step.seconds
    name = f"step {step.number}" if done else f"step {step.number} (under way)"
    args: dict[str, Any] = {"step": step.number, "micro_batches": step.backwards, "collectives": len(step.arrivals)}
    if done:
        args["seconds"] = round(step.seconds, 6)
        args["stages_ms"] = {STAGE_NAMES.get(k, k): round(v * 1e3, 3) for k, v in step.stages.items()}
    else:
        stopped = open_stages[-1][0] if open_stages else "other"
        args["now_in"] = STAGE_NAMES.get(stopped, stopped)
        args["seconds_so_far"] = round(step.seconds, 6)
    waits = [wait for _, wait in lags.values()]
    if waits:
        args["collective_wait_ms"] = round(sum(waits) * 1e3, 3)
    events = [_slice(name, "step", start, end, pid, tid, args, shift)]
    blocks = [(stage, b, e, False) for stage, b, e in step.spans]
    blocks += [(stage, since, end, True) for stage, since in open_stages]
    cursor = start
    for stage, b, e, still_open in _flat(blocks, start, end):
        if b - cursor >= MIN_GAP:
            events.append(_slice(STAGE_NAMES["other"], "stage", cursor, b, pid, tid, {"step": step.number}, shift))
        block_args: dict[str, Any] = {"step": step.number}
        if still_open:
            block_args["open"] = True
        events.append(_slice(STAGE_NAMES.get(stage, stage), "stage", b, e, pid, tid, block_args, shift))
        cursor = e
    if done and end - cursor >= MIN_GAP:
        events.append(_slice(STAGE_NAMES["other"], "stage", cursor, end, pid, tid, {"step": step.number}, shift))
    for k, t in enumerate(step.arrivals):
        call: dict[str, Any] = {"step": step.number, "index": k}
        if k in lags:
            lag, wait = lags[k]
            call["lag_ms"] = round(lag * 1e3, 3)
            call["wait_for_last_ms"] = round(wait * 1e3, 3)
        events.append({"name": f"collective {k}", "ph": "i", "s": "t", "ts": _us(t, shift), "pid": pid, "tid": tid,
                       "cat": "collective", "args": call})
    return events


def _flat(blocks: list[tuple[str, float, float, bool]], start: float, end: float) -> list[tuple[str, float, float, bool]]:
    """The blocks within [start, end], in time order, none overlapping the one before (a
    block of another thread of the rank is cut where it overlaps): slices of one track
    must nest, and stages of one step do not."""
    out: list[tuple[str, float, float, bool]] = []
    cursor = start
    for stage, b, e, still_open in sorted(blocks, key=lambda block: (block[1], block[2])):
        b, e = max(b, cursor), min(e, end)
        if e > b:
            out.append((stage, b, e, still_open))
            cursor = e
    return out


def _lags(ranks: Sequence[tuple[RankHistory, float]]) -> dict[tuple[str, str, float], dict[int, tuple[float, float]]]:
    """(job, rank, step start in Unix time) -> collective index -> (lag behind the first
    rank, wait for the last). The same step of every rank is found by its number: each
    rank's numbers are shifted to the first rank's by the shift most of its steps agree on
    (the step that starts nearest, as ``tl.match_arrivals`` matches them; agents attached
    at different times count from different steps), so that a step skewed by a preemption
    past half a step is not matched with its neighbour. A step whose call count differs
    between ranks is left out; the step under way is matched among the ranks that called
    each collective so far."""
    jobs: dict[str, dict[str, RankHistory]] = {}
    for r, offset in ranks:
        jobs.setdefault(r.job_id, {})[r.rank] = _on_unix_time(r, offset)
    out: dict[tuple[str, str, float], dict[int, tuple[float, float]]] = {}
    for job, members in jobs.items():
        if len(members) < 2:
            continue
        names = sorted(members, key=_rank_order)
        reference = members[names[0]]
        numbered = {name: {s.number: s for s in (*members[name].steps, *_current(members[name]))} for name in names}
        shifts = {names[0]: 0}
        for name in names[1:]:
            shift = _shift(reference.steps, members[name].steps)
            if shift is not None:
                shifts[name] = shift
        for number, step in numbered[names[0]].items():
            same = {name: numbered[name].get(number + shift) for name, shift in shifts.items()}
            present = {name: s for name, s in same.items() if s is not None}
            if len(present) < 2:
                continue
            under_way = step is reference.current
            for k in range(max(len(s.arrivals) for s in present.values())):
                if not under_way and any(len(s.arrivals) != len(step.arrivals) for s in present.values()):
                    break
                called = {name: s.arrivals[k] for name, s in present.items() if k < len(s.arrivals)}
                if len(called) < 2 or (not under_way and len(called) < len(members)):
                    continue
                first, last = min(called.values()), max(called.values())
                for name, t in called.items():
                    out.setdefault((job, name, present[name].start), {})[k] = (t - first, last - t)
    return out


def _current(r: RankHistory) -> tuple[PicturedStep, ...]:
    return (r.current,) if r.current is not None else ()


def _shift(reference: Sequence[PicturedStep], other: Sequence[PicturedStep]) -> int | None:
    """How much ``other``'s step numbers exceed ``reference``'s for the same step: the
    difference most of the nearest-starting pairs agree on (None without any pair)."""
    starts = [s.start for s in other]
    votes: Counter[int] = Counter()
    for s in reference:
        i = bisect.bisect_left(starts, s.start)
        near = [other[j] for j in (i - 1, i) if 0 <= j < len(other) and abs(starts[j] - s.start) <= s.seconds / 2]
        if near:
            votes[min(near, key=lambda o: abs(o.start - s.start)).number - s.number] += 1
    return votes.most_common(1)[0][0] if votes else None


def _on_unix_time(r: RankHistory, offset: float) -> RankHistory:
    def step(s: PicturedStep) -> PicturedStep:
        return PicturedStep(s.number, s.start + offset, s.seconds, s.stages, s.backwards,
                            tuple(t + offset for t in s.arrivals), ())

    return RankHistory(r.job_id, r.rank, r.pid, r.node, tuple(step(s) for s in r.steps),
                       step(r.current) if r.current is not None else None)


def _slice(name: str, cat: str, begin: float, end: float, pid: int, tid: int, args: Mapping[str, Any],
           shift: float) -> dict[str, Any]:
    ts = _us(begin, shift)
    return {"name": name, "ph": "X", "cat": cat, "ts": ts, "dur": max(0.0, round(_us(end, shift) - ts, 3)),
            "pid": pid, "tid": tid, "args": dict(args)}


def _meta(name: str, pid: int, tid: int, args: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": dict(args)}


def _us(t: float, shift: float) -> float:
    return round((t + shift) * 1e6, 3)


def _rank_order(rank: str) -> tuple[int, str]:
    return (int(rank), rank) if rank.isdigit() else (1 << 30, rank)


# -- the history as /api/timeline serves it (JSON), and read back from a node's agent ------
MAX_RANKS = 4096  # ranks read from one agent's answer
MAX_STEPS = 1_000_000  # steps read from one agent's answer, all ranks together


def history_json(history: TimelineHistory) -> dict[str, Any]:
    """``history`` as JSON data (docs/openapi.yaml, TimelineHistory)."""
    return {"node": history.node, "now": history.now, "clock_offset": history.clock_offset,
            "ranks": [{"job_id": r.job_id, "rank": r.rank, "pid": r.pid, "node": r.node,
                       "steps": [_step_json(s) for s in r.steps],
                       "current": _step_json(r.current) if r.current is not None else None,
                       "open_stages": [list(block) for block in r.open_stages], "last_event": r.last_event}
                      for r in history.ranks]}


def _step_json(s: PicturedStep) -> dict[str, Any]:
    return {"number": s.number, "start": s.start, "seconds": s.seconds, "stages": dict(s.stages),
            "backwards": s.backwards, "arrivals": list(s.arrivals), "spans": [list(span) for span in s.spans]}


class BadHistory(ValueError):
    """An agent's answer that is not a timeline history (said in one line)."""


def history_from_json(data: Any) -> TimelineHistory:
    """The history in an agent's answer, every field checked (another node's agent is
    read over the network): BadHistory naming the first field that is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("ranks"), list):
        raise BadHistory("not a timeline history (no ranks list)")
    node = _text(data.get("node", ""), "node")
    now, offset = _number(data.get("now"), "now"), _number(data.get("clock_offset"), "clock_offset")
    ranks = []
    budget = MAX_STEPS
    for item in data["ranks"][:MAX_RANKS]:
        if not isinstance(item, dict) or not isinstance(item.get("steps"), list):
            raise BadHistory("a rank without a steps list")
        steps = []
        for s in item["steps"][:budget]:
            steps.append(_step_from(s))
        budget -= len(steps)
        current = item.get("current")
        open_stages = item.get("open_stages") or []
        if not isinstance(open_stages, list):
            raise BadHistory("open_stages is not a list")
        last = item.get("last_event")
        ranks.append(RankHistory(
            _text(item.get("job_id", ""), "job_id"), _text(item.get("rank", ""), "rank"), _int(item.get("pid", 0), "pid"),
            _text(item.get("node", node), "node"), tuple(steps), _step_from(current) if current is not None else None,
            tuple((_stage(b[0] if isinstance(b, list) and len(b) == 2 else None), _number(b[1], "open_stages"))
                  for b in open_stages[:64]),
            _number(last, "last_event") if last is not None else None))
    return TimelineHistory(node, now, offset, tuple(ranks))


def _step_from(s: Any) -> PicturedStep:
    if not isinstance(s, dict):
        raise BadHistory("a step is not an object")
    stages = s.get("stages") or {}
    arrivals, spans = s.get("arrivals") or [], s.get("spans") or []
    if not isinstance(stages, dict) or not isinstance(arrivals, list) or not isinstance(spans, list):
        raise BadHistory("a step's stages, arrivals or spans are of the wrong type")
    return PicturedStep(
        _int(s.get("number"), "number"), _number(s.get("start"), "start"), _number(s.get("seconds"), "seconds"),
        {_stage(k): _number(v, "stages") for k, v in stages.items()}, _int(s.get("backwards", 0), "backwards"),
        tuple(_number(t, "arrivals") for t in arrivals[:tl.MAX_ARRIVALS]),
        tuple((_stage(x[0]), _number(x[1], "spans"), _number(x[2], "spans"))
              for x in (_triple(x) for x in spans[:tl.MAX_SPANS])))


def _triple(x: Any) -> list[Any]:
    if not isinstance(x, list) or len(x) != 3:
        raise BadHistory("a span is not [stage, begin, end]")
    return x


def _stage(x: Any) -> str:
    if x not in tl.STAGES:
        raise BadHistory(f"unknown stage {str(x)[:40]!r}")
    return str(x)


def _text(x: Any, what: str) -> str:
    if not isinstance(x, str):
        raise BadHistory(f"{what} is not a string")
    return x[:200]


def _number(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) or x != x or x in (float("inf"), float("-inf")):
        raise BadHistory(f"{what} is not a finite number")
    return float(x)


def _int(x: Any, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise BadHistory(f"{what} is not an integer")
    return x

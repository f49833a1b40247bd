"""Each rank's training steps from probe events (pure: events in, figures out).

A step runs from one ``Optimizer.step`` call to the next. Within it, the stages are the
DataLoader waits (``__next__``), the backwards (``Engine::execute`` to its last act), the
optimizer (``Optimizer.step`` and ``zero_grad``), and the rest, ``other`` (forward and
host work). A block is counted in the step in which it ends. Collective arrivals are the
calls into the process group; the k-th call of a step on every rank is one collective,
and its arrival lag on a rank is how long after the first rank that rank called it.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

STAGES = ("data_wait", "backward", "optimizer", "other")
# Seconds; the first bucket below a fast step on a CPU, the last above a checkpoint save.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LAG_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
MAX_OPEN = 64  # open blocks per thread: a job that never closes what it opens cannot grow us
MAX_ARRIVALS = 4096  # collective calls kept per step
RECENT_STEPS = 2048  # steps kept per rank for the window figures and the cross-rank match
HISTORY_STEPS = 4096  # steps kept per rank for the picture (timeline.history_steps)
MAX_SPANS = 256  # stage blocks kept per step for the picture: a job opening more cannot grow us

# What a probe saw; ``detail`` is the collective's name for COLLECTIVE.
STEP, ZERO_GRAD, DATA, RECORD, RECORD_EXIT, BACKWARD, BACKWARD_END, COLLECTIVE = (
    "step", "zero_grad", "data", "record", "record_exit", "backward", "backward_end", "collective")


def record_kind(head: bytes) -> str:
    """The kind of a ``record_function`` from the first 16 bytes of its name (torch names
    these blocks itself: ``Optimizer.step#AdamW.step``, ``Optimizer.zero_grad#...``,
    ``enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__``)."""
    if head.startswith(b"Optimizer.step#"):
        return STEP
    if head.startswith(b"Optimizer.zero_g"):
        return ZERO_GRAD
    if head.startswith(b"enumerate(DataLo"):
        return DATA
    return RECORD

_STAGE_OF = {DATA: "data_wait", BACKWARD: "backward", STEP: "optimizer", ZERO_GRAD: "optimizer"}
_EXITS = frozenset((RECORD_EXIT, BACKWARD_END))
_RESETS = frozenset((STEP, DATA))  # blocks never opened inside a backward


class Step(NamedTuple):  # one per step of every rank: a NamedTuple is built ten times faster than a frozen dataclass
    """One completed step: its start (monotonic seconds), length and stage times."""

    start: float
    seconds: float
    stages: Mapping[str, float]
    backwards: int
    arrivals: tuple[float, ...]  # the step's collective calls, in order


class Pictured(NamedTuple):
    """One completed step as the picture shows it: its number (counted from the first step
    the probes saw), the step, and its stage blocks as (stage, begin, end)."""

    number: int
    step: Step
    spans: tuple[tuple[str, float, float], ...]


class InProgress(NamedTuple):
    """The step a rank is in: where it stopped, if it hangs."""

    start: float | None  # None before the first optimizer step
    spans: tuple[tuple[str, float, float], ...]  # its stage blocks done so far
    open_blocks: tuple[tuple[str, float], ...]  # stage blocks still open: (stage, since)
    arrivals: tuple[float, ...]  # its collective calls so far
    backwards: int


@dataclass
class RankTimeline:
    """The running figures of one rank process, fed its events in time order."""

    optimizer_steps: int = 0  # Optimizer.step calls seen
    steps_total: int = 0  # completed steps: from one call to the next
    step_seconds_sum: float = 0.0
    step_buckets: list[int] = field(default_factory=lambda: [0] * len(STEP_BUCKETS))
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    backwards_total: int = 0
    collectives_total: int = 0
    recent: deque[Step] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    history: deque[Pictured] = field(default_factory=lambda: deque(maxlen=HISTORY_STEPS))
    last_event: float | None = None
    last_step: float | None = None  # when Optimizer.step was last called
    _open: dict[int, list[tuple[str, float]]] = field(default_factory=dict)  # tid -> open blocks
    _step_start: float | None = None
    _current: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    _backwards: int = 0
    _arrivals: list[float] = field(default_factory=list)
    _spans: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def arrivals_in_step(self) -> list[float]:
        """The collectives called since the last optimizer step."""
        return self._arrivals

    @property
    def stage_now(self) -> str:
        """The stage of the innermost open block of any thread ("" outside any): asked
        once a collect, so worked out here rather than at each of thousands of events."""
        newest: tuple[str, float] | None = None
        for stack in self._open.values():
            for kind, began in stack:
                if kind != RECORD and (newest is None or began > newest[1]):
                    newest = (kind, began)
        return "" if newest is None else _STAGE_OF[newest[0]]

    def feed(self, kind: str, tid: int, t: float) -> None:
        # Called for every probe hit of every rank (thousands a second at 8 ranks): the
        # common paths are a few dict and list operations, with no further call.
        self.last_event = t
        if kind in _EXITS:
            stack = self._open.get(tid)
            if not stack:
                return
            backward = kind == BACKWARD_END
            top = stack[-1]
            if (top[0] == BACKWARD) is backward:
                stack.pop()
            else:  # an inner block still open: a backward's end inside its record blocks, say
                at = next((i for i in range(len(stack) - 2, -1, -1) if (stack[i][0] == BACKWARD) is backward), None)
                if at is None:  # an exit whose entry came before the probes
                    return
                top = stack.pop(at)
            opened, began = top
            if opened == BACKWARD:
                self._backwards += 1
                self.backwards_total += 1
            stage = _STAGE_OF.get(opened)
            start = self._step_start
            if stage is not None and start is not None:
                since = began if began > start else start  # a block is counted in the step it ends in
                if t > since:
                    self._current[stage] += t - since
                    if len(self._spans) < MAX_SPANS:
                        self._spans.append((stage, since, t))
            return
        if kind == COLLECTIVE:
            self.collectives_total += 1
            if len(self._arrivals) < MAX_ARRIVALS:
                self._arrivals.append(t)
            return
        stack = self._open.get(tid)
        if stack is None:
            stack = self._open[tid] = []
        if kind in _RESETS:
            if kind == STEP:
                self.optimizer_steps += 1
                self.last_step = t
                self._boundary(t)
            if any(block[0] == BACKWARD for block in stack):  # never inside a backward: it raised
                stack[:] = [block for block in stack if block[0] != BACKWARD]
        if len(stack) < MAX_OPEN:
            stack.append((kind, t))

    def _boundary(self, t: float) -> None:
        start = self._step_start
        if start is not None and t > start:
            seconds = t - start
            stages = self._current
            stages["other"] = max(0.0, seconds - stages["data_wait"] - stages["backward"] - stages["optimizer"])
            self.steps_total += 1
            self.step_seconds_sum += seconds
            index = bisect.bisect_left(STEP_BUCKETS, seconds)
            if index < len(STEP_BUCKETS):
                self.step_buckets[index] += 1
            totals = self.stage_seconds
            for stage, value in stages.items():
                totals[stage] += value
            step = Step(start, seconds, stages, self._backwards, tuple(self._arrivals))
            self.recent.append(step)
            self.history.append(Pictured(self.steps_total, step, tuple(self._spans)))
        self._step_start = t
        self._current = dict.fromkeys(STAGES, 0.0)
        self._backwards = 0
        self._arrivals = []
        self._spans = []

    def in_progress(self) -> InProgress:
        """The step under way: where a rank that hangs stopped."""
        start = self._step_start
        open_blocks = sorted(((_STAGE_OF[kind], began if start is None or began > start else start)
                              for stack in self._open.values() for kind, began in stack if kind != RECORD),
                             key=lambda block: block[1])
        return InProgress(start, tuple(self._spans), tuple(open_blocks), tuple(self._arrivals), self._backwards)


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile by linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def window(steps: Iterable[Step], since: float) -> list[Step]:
    """The steps that ended at or after ``since`` (monotonic seconds)."""
    return [s for s in steps if s.start + s.seconds >= since]


@dataclass(frozen=True)
class Arrival:
    """One collective of one step as each rank called it."""

    step_start: float  # the reference rank's step start
    index: int  # k-th collective call of the step
    times: Mapping[str, float]  # rank -> call time

    def lags(self) -> dict[str, float]:
        first = min(self.times.values())
        return {rank: t - first for rank, t in self.times.items()}


def match_arrivals(ranks: Mapping[str, Sequence[Step]], after: float) -> tuple[list[Arrival], float]:
    """The collectives of the steps that every rank completed and that began after
    ``after`` (the reference rank's clock), matched across ranks; and the start of the
    last step looked at, to pass as ``after`` next time.

    Steps are matched by start: every rank starts a step's optimizer right after the
    step's last collective, so the same step starts within a fraction of a step on
    every rank. A step whose call count differs between ranks is left out (a rank
    attached or restarted mid-step); one that a rank has not finished yet is left for
    the next call."""
    if len(ranks) < 2:
        return [], after
    names = sorted(ranks, key=_rank_order)
    reference = names[0]
    out: list[Arrival] = []
    starts = {r: [s.start for s in ranks[r]] for r in names[1:]}
    for step in ranks[reference]:
        if step.start <= after:
            continue
        matched = {reference: step}
        for r in names[1:]:
            other = _nearest(ranks[r], starts[r], step.start, step.seconds / 2)
            if other is None:
                if not starts[r] or starts[r][-1] < step.start:
                    return out, after  # not finished there yet: look again later
                break
            if len(other.arrivals) != len(step.arrivals):
                break
            matched[r] = other
        else:
            for k in range(len(step.arrivals)):
                out.append(Arrival(step.start, k, {r: s.arrivals[k] for r, s in matched.items()}))
        after = step.start
    return out, after


def _nearest(steps: Sequence[Step], starts: list[float], t: float, tolerance: float) -> Step | None:
    i = bisect.bisect_left(starts, t)
    best: Step | None = None
    for j in (i - 1, i):
        if 0 <= j < len(steps) and abs(starts[j] - t) <= tolerance \
                and (best is None or abs(starts[j] - t) < abs(best.start - t)):
            best = steps[j]
    return best


def _rank_order(rank: str) -> tuple[int, str]:
    return (int(rank), rank) if rank.isdigit() else (1 << 30, rank)


@dataclass(frozen=True)
class LastArrivals:
    """Who arrived last, over a window of matched collectives of one job."""

    collectives: int
    last_counts: Mapping[str, int]  # rank -> collectives at which it was last
    median_lag: Mapping[str, float]  # rank -> its median lag behind the first
    step_seconds: float  # median step time of the job over the window
    step_lag: Mapping[str, float]  # rank -> its lags of a step added up, at the median over steps


def last_arrivals(arrivals: Sequence[Arrival], step_seconds: float, tie: float = 50e-6,
                  back_to_back: float = 1e-3) -> LastArrivals:
    """Count, per rank, the collectives it called last (by more than ``tie`` seconds
    over the runner-up, so that ranks arriving together name no one), and add up each
    rank's lags over each step: FSDP calls a collective per layer, each late by a slice of
    the step, so one collective's lag understates what the others wait. A call that every
    rank made within ``back_to_back`` seconds of its previous one adds nothing: calls with
    no work between (one call hitting two probed functions, FSDP's gather of a layer's
    parameters in a few calls) are one wait."""
    counts: dict[str, int] = {}
    lags: dict[str, list[float]] = {}
    per_step: dict[float, dict[str, float]] = {}
    previous: dict[float, dict[str, float]] = {}
    for a in sorted(arrivals, key=lambda a: (a.step_start, a.index)):
        ordered = sorted(a.times.items(), key=lambda kv: kv[1])
        if len(ordered) >= 2 and ordered[-1][1] - ordered[-2][1] > tie:
            counts[ordered[-1][0]] = counts.get(ordered[-1][0], 0) + 1
        now = a.lags()
        for rank, lag in now.items():
            lags.setdefault(rank, []).append(lag)
        before = previous.get(a.step_start)
        if before is None or any(t - before.get(rank, float("-inf")) > back_to_back for rank, t in a.times.items()):
            total = per_step.setdefault(a.step_start, {})
            for rank, lag in now.items():
                total[rank] = total.get(rank, 0.0) + lag
        previous[a.step_start] = dict(a.times)
    step_lag: dict[str, list[float]] = {}
    for total in per_step.values():
        for rank, lag in total.items():
            step_lag.setdefault(rank, []).append(lag)
    return LastArrivals(len(arrivals), counts, {r: quantile(v, 0.5) for r, v in lags.items()}, step_seconds,
                        {r: quantile(v, 0.5) for r, v in step_lag.items()})

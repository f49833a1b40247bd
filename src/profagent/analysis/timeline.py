"""Each rank's training steps from probe events (pure: events in, figures out).

A step runs from one ``Optimizer.step`` call to the next; where no such block ever comes
(a compiled optimizer step), from one ``zero_grad`` call or one backward pass to the next.
The stages are the DataLoader waits, the backwards (``Engine::execute`` to its last act),
the optimizer (``Optimizer.step`` and ``zero_grad``) and the rest, ``other``. Blocks nest
and time is counted once: a backward inside the optimizer's block (a closure) is the
backward's. A block is counted in the step in which it ends. Collective arrivals are the
calls into the process group; the k-th call of a step on every rank is one collective,
and its arrival lag on a rank is how long after the first rank that rank called it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

STAGES = ("data_wait", "backward", "optimizer", "other")
# Seconds; the first bucket below a fast step on a CPU, the last above a checkpoint save.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LAG_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
MAX_OPEN = 64  # open blocks per thread: a job that never closes what it opens cannot grow us
MAX_OPEN_RANK = 1024  # open blocks per rank, all its threads together (thread churn)
MAX_ARRIVALS = 4096  # collective calls kept per step
RECENT_STEPS = 2048  # steps kept per rank for the window figures and the cross-rank match
HELD_EVENTS = 8192  # events held while a rank's step boundary is not known yet
DECIDE_BACKWARDS = 32  # backwards with no Optimizer.step block: the steps come from elsewhere
DECIDE_SECONDS = 60.0  # or this long with a few backwards and no Optimizer.step block
NONE_AFTER = 30.0  # seconds of events with no boundary before a rank is said to have none
HISTORY_STEPS = 4096  # steps kept per rank for the picture (timeline.history_steps)
MAX_SPANS = 256  # stage blocks kept per step for the picture: a job opening more cannot grow us

# What a probe saw; ``detail`` is the collective's name for COLLECTIVE.
STEP, ZERO_GRAD, DATA, RECORD, RECORD_EXIT, BACKWARD, BACKWARD_END, COLLECTIVE = (
    "step", "zero_grad", "data", "record", "record_exit", "backward", "backward_end", "collective")
# Where a rank's steps begin: each Optimizer.step call; else each Optimizer.zero_grad call
# (a compiled optimizer step drops its record_function, an uncompiled zero_grad keeps its
# own); else each backward pass (the one after DDP's synchronising backward with gradient
# accumulation); NONE where no boundary can be had.
OPTIMIZER, BY_ZERO_GRAD, BY_BACKWARD, NONE = "optimizer", "zero_grad", "backward", "none"

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
# An open block: [kind, start, inner seconds, the step its inner seconds belong to, a
# backward ended inside it]. An Optimizer.step block's start moves to the end of each
# backward inside it: what ran before (the closure's forward) is not the optimizer's.
KIND, BEGAN, INNER, INNER_STEP, HAD_BACKWARD = range(5)


class Step(NamedTuple):  # one per step of every rank: a NamedTuple is built ten times faster than a frozen dataclass
    """One completed step: its start (monotonic seconds), length and stage times."""

    start: float
    seconds: float
    stages: Mapping[str, float]
    backwards: int
    arrivals: tuple[float, ...]  # the step's collective calls, in order


def boundary_note(boundary: str) -> str:
    """One line on where a rank's steps come from when not from Optimizer.step ("" then)."""
    fix = "set torch._dynamo.config.capture_profiler_record_function = True in the job for exact steps and stages"
    if boundary == BY_ZERO_GRAD:
        return ("steps from Optimizer.zero_grad calls: no Optimizer.step block arrives (a compiled optimizer step "
                f"drops it), so the optimizer's update counts as other; {fix}")
    if boundary == BY_BACKWARD:
        return ("steps from backward passes: no Optimizer.step block arrives (a compiled optimizer step drops it); "
                f"gradient accumulation without DDP counts each micro-batch as a step; {fix}")
    if boundary == NONE:
        return ("no step boundary: neither an Optimizer.step block nor a backward pass arrives (a compiled "
                f"optimizer step drops its block); {fix}")
    return ""


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
    """The running figures of one rank process, fed its events in time order.

    Until its first Optimizer.step block, a rank's events are held (HELD_EVENTS): if no
    such block comes within DECIDE_BACKWARDS backwards, the steps are taken from
    Optimizer.zero_grad calls or backward passes and the held events are read again."""

    optimizer_steps: int = 0  # steps begun: Optimizer.step calls, or the boundaries taken instead
    steps_total: int = 0  # completed steps: from one boundary to the next
    step_seconds_sum: float = 0.0
    step_buckets: list[int] = field(default_factory=lambda: [0] * len(STEP_BUCKETS))
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    backwards_total: int = 0
    collectives_total: int = 0
    recent: deque[Step] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    history: deque[Pictured] = field(default_factory=lambda: deque(maxlen=HISTORY_STEPS))
    last_event: float | None = None
    last_step: float | None = None  # when the last step began
    boundary: str = ""  # OPTIMIZER, BY_ZERO_GRAD, BY_BACKWARD, NONE; "" while held
    dropped_blocks: int = 0  # blocks not kept: a thread or the rank had too many open
    _open: dict[int, list[list]] = field(default_factory=dict)  # tid -> its open blocks, none empty
    _open_count: int = 0
    _step_start: float | None = None
    _step_no: int = 0
    _current: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    _backwards: int = 0
    _arrivals: list[float] = field(default_factory=list)
    _held: list[tuple[str, int, float]] | None = field(default_factory=list)
    _first_event: float | None = None
    _undecided_backwards: int = 0  # backwards ended while no boundary is known
    _zero_grads: int = 0
    _backward_mark: int = 0  # collectives_total when the outermost backward began
    _last_synced: bool = True  # the last backward called collectives (the first begins a step)
    _synced_seen: bool = False  # a backward of this rank called collectives
    _closure: bool = False  # the last Optimizer.step block ran a backward (a closure)
    _spans: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def arrivals_in_step(self) -> list[float]:
        """The collectives called since the last step began."""
        return self._arrivals

    @property
    def step_boundary(self) -> str:
        """Where the rank's steps come from; NONE once events have arrived for NONE_AFTER
        seconds with no boundary; "" before that."""
        if self.boundary:
            return self.boundary
        if self._first_event is not None and self.last_event is not None \
                and self.last_event - self._first_event >= NONE_AFTER:
            return NONE
        return ""

    @property
    def stage_now(self) -> str:
        """The stage of the innermost open block of any thread ("" outside any): asked
        once a collect, so worked out here rather than at each of thousands of events;
        it reads at most MAX_OPEN_RANK blocks."""
        newest: list | None = None
        for stack in self._open.values():
            for block in stack:
                if block[KIND] != RECORD and (newest is None or block[BEGAN] > newest[BEGAN]):
                    newest = block
        if newest is None:
            return ""
        if newest[KIND] == STEP and self._closure and not newest[HAD_BACKWARD]:
            return ""  # a closure's forward, before its backward
        return _STAGE_OF[newest[KIND]]

    @property
    def open_threads(self) -> list[int]:
        """The threads with blocks open."""
        return list(self._open)

    def forget_threads(self, exited: Iterable[int]) -> None:
        """Drop the open blocks of threads that exited: a job churning threads that never
        close what they open would otherwise hold MAX_OPEN_RANK blocks for good."""
        for tid in exited:
            stack = self._open.pop(tid, None)
            if stack is not None:
                self._open_count -= len(stack)

    def feed(self, kind: str, tid: int, t: float) -> None:
        held = self._held
        if held is not None:
            self._hold(held, kind, tid, t)
        self._apply(kind, tid, t)

    def _hold(self, held: list[tuple[str, int, float]], kind: str, tid: int, t: float) -> None:
        """Keep the event for a second reading; decide the boundary when it can be."""
        if self._first_event is None:
            self._first_event = t
        held.append((kind, tid, t))
        backwards = self._undecided_backwards
        if kind == STEP:
            self._decide(OPTIMIZER)
        elif backwards >= DECIDE_BACKWARDS or (backwards >= 4 and t - self._first_event >= DECIDE_SECONDS):
            self._decide(BY_ZERO_GRAD if self._zero_grads >= 2 else BY_BACKWARD)
        elif len(held) >= HELD_EVENTS:  # a few backwards in many events: they are the steps still
            self._decide(NONE if backwards < 2 else BY_ZERO_GRAD if self._zero_grads >= 2 else BY_BACKWARD)

    def _decide(self, boundary: str) -> None:
        """Read the held events again (all but the one being fed) with the boundary known."""
        held = self._held or []
        first, synced, kept = self._first_event, self._synced_seen, self.history.maxlen
        self.__init__(history=deque(maxlen=kept))  # type: ignore[misc]
        self._held = None
        self.boundary = boundary
        self._first_event = first
        self._synced_seen = synced  # DDP's: the backwards under no_sync before it begin no step
        for kind, tid, t in held[:-1]:
            self._apply(kind, tid, t)

    def _apply(self, kind: str, tid: int, t: float) -> None:
        # Called for every probe hit of every rank (thousands a second at 8 ranks): the
        # common paths are a few dict and list operations.
        self.last_event = t
        if kind in _EXITS:
            self._exit(kind, tid, t)
            return
        if kind == COLLECTIVE:
            self.collectives_total += 1
            if len(self._arrivals) < MAX_ARRIVALS:
                self._arrivals.append(t)
            return
        stack = self._open.get(tid) or []
        boundary = self.boundary
        if kind == STEP:
            if any(block[KIND] == STEP for block in stack):
                pass  # an optimizer's step inside another's (a wrapping optimizer): one step
            else:
                if boundary != OPTIMIZER:  # the block came after all: it is the boundary from now on
                    self.boundary = boundary = OPTIMIZER
                    self._step_start = None
                self._begin(t)
        elif kind == BACKWARD:
            if not any(block[KIND] == BACKWARD for block in stack):  # the outermost: not a reentrant one
                if boundary == NONE and self._undecided_backwards >= DECIDE_BACKWARDS:
                    self.boundary = boundary = BY_ZERO_GRAD if self._zero_grads >= 2 else BY_BACKWARD
                if boundary == BY_BACKWARD and (self._last_synced or not self._synced_seen):
                    self._begin(t)
                self._backward_mark = self.collectives_total
        elif kind == ZERO_GRAD:
            self._zero_grads += 1
            if boundary == BY_ZERO_GRAD:
                self._begin(t)
        if kind in _RESETS and any(block[KIND] == BACKWARD for block in stack):  # never inside a backward: it raised
            kept = [block for block in stack if block[KIND] != BACKWARD]
            self._open_count -= len(stack) - len(kept)
            stack[:] = kept
        if len(stack) < MAX_OPEN and self._open_count < MAX_OPEN_RANK:
            stack.append([kind, t, 0.0, 0, False])
            self._open_count += 1
            self._open[tid] = stack
        else:
            self.dropped_blocks += 1
            if not stack:
                self._open.pop(tid, None)

    def _exit(self, kind: str, tid: int, t: float) -> None:
        stack = self._open.get(tid)
        if not stack:
            return
        backward = kind == BACKWARD_END
        at = len(stack) - 1
        if (stack[at][KIND] == BACKWARD) is not backward:  # an inner block still open: a backward's end inside its record blocks, say
            at = next((i for i in range(at - 1, -1, -1) if (stack[i][KIND] == BACKWARD) is backward), -1)
            if at < 0:  # an exit whose entry came before the probes
                return
        block = stack.pop(at)
        self._open_count -= 1
        if not stack:
            del self._open[tid]
        opened, began = block[KIND], block[BEGAN]
        if opened == BACKWARD:
            self._backwards += 1
            self.backwards_total += 1
            if self.boundary in ("", NONE):
                self._undecided_backwards += 1
        stage = _STAGE_OF.get(opened)
        start = self._step_start
        if stage is None:
            return
        outermost_backward = opened == BACKWARD and not any(b[KIND] == BACKWARD for b in stack[:at])
        if outermost_backward:
            self._last_synced = self.collectives_total > self._backward_mark
            self._synced_seen = self._synced_seen or self._last_synced
        if opened == STEP:
            self._closure = block[HAD_BACKWARD]
        if start is None:
            return
        since = began if began > start else start  # a block is counted in the step it ends in
        if t <= since:
            return
        seconds = t - since
        inner = block[INNER] if block[INNER_STEP] == self._step_no else 0.0
        self._current[stage] += max(0.0, seconds - inner)
        if len(self._spans) < MAX_SPANS:  # the picture's block: nested ones are drawn inside it
            self._spans.append((stage, since, t))
        # the enclosing block of a stage gives this time up: it is counted once, here
        parent = next((stack[i] for i in range(at - 1, -1, -1) if stack[i][KIND] != RECORD), None)
        if parent is None:
            return
        if parent[KIND] == STEP and opened == BACKWARD:
            parent[BEGAN], parent[INNER], parent[HAD_BACKWARD] = t, 0.0, True
        elif parent[INNER_STEP] == self._step_no:
            parent[INNER] += seconds
        else:
            parent[INNER], parent[INNER_STEP] = seconds, self._step_no

    def _begin(self, t: float) -> None:
        """A step begins at ``t``: the one before ends there."""
        self.optimizer_steps += 1
        self.last_step = t
        start = self._step_start
        if start is not None and t > start:
            seconds = t - start
            stages = self._current
            counted = stages["data_wait"] + stages["backward"] + stages["optimizer"]
            if counted > seconds:  # blocks of several threads overlapped: shares of the step still
                for stage in ("data_wait", "backward", "optimizer"):
                    stages[stage] *= seconds / counted
                counted = seconds
            stages["other"] = seconds - counted
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
        self._step_no += 1
        self._current = dict.fromkeys(STAGES, 0.0)
        self._backwards = 0
        self._arrivals = []
        self._spans = []

    def in_progress(self) -> InProgress:
        """The step under way: where a rank that hangs stopped."""
        start = self._step_start
        open_blocks = sorted(((_STAGE_OF[b[KIND]], b[BEGAN] if start is None or b[BEGAN] > start else start)
                              for stack in self._open.values() for b in stack if b[KIND] != RECORD),
                             key=lambda block: block[1])
        return InProgress(start, tuple(self._spans), tuple(open_blocks), tuple(self._arrivals), self._backwards)


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile by linear interpolation between closest ranks (numpy's default)."""
    return quantile_sorted(sorted(values), q)


def quantile_sorted(ordered: Sequence[float], q: float) -> float:
    """``quantile`` of values already in ascending order."""
    if not ordered:
        return math.nan
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def window(steps: Iterable[Step], since: float) -> list[Step]:
    """The steps that ended at or after ``since`` (monotonic seconds)."""
    return [s for s in steps if s.start + s.seconds >= since]


class StepWindow:
    """A rank's steps of a sliding window with their figures kept as steps come and go:
    what ``window(recent, since)`` and sums over it give, at a cost per step rather than
    per read (a collect read 2048 steps of every rank each second). Steps end in order,
    so the oldest leave first; at most ``cap`` are kept, as the rank's ``recent`` does."""

    def __init__(self, cap: int = RECENT_STEPS) -> None:
        self.cap = cap
        self.steps: deque[Step] = deque()
        self.ordered: list[float] = []  # the steps' seconds, ascending
        self.seconds = 0.0
        self.stages = dict.fromkeys(STAGES, 0.0)
        self.backwards = 0
        self._source: deque[Step] | None = None
        self._seen = 0

    def follow(self, recent: deque[Step], total: int) -> None:
        """Take in the steps appended to ``recent`` since the last call (``total``: the
        steps ever appended to it). A new ``recent`` (a rank's figures begun again) starts over."""
        if recent is not self._source or total < self._seen:
            self.__init__(self.cap)  # type: ignore[misc]
            self._source = recent
        new = min(total - self._seen, len(recent))
        self._seen = total
        if new > 0:
            for step in reversed(list(itertools.islice(reversed(recent), new))):
                self.add(step)

    def add(self, step: Step) -> None:
        self.steps.append(step)
        bisect.insort(self.ordered, step.seconds)
        self.seconds += step.seconds
        for stage, value in step.stages.items():
            self.stages[stage] = self.stages.get(stage, 0.0) + value
        self.backwards += step.backwards
        if len(self.steps) > self.cap:
            self._drop()

    def expire(self, since: float) -> None:
        """Let go of the steps that ended before ``since``."""
        steps = self.steps
        while steps and steps[0].start + steps[0].seconds < since:
            self._drop()

    def _drop(self) -> None:
        step = self.steps.popleft()
        del self.ordered[bisect.bisect_left(self.ordered, step.seconds)]
        if not self.steps:  # no rounding left over from sums taken apart
            self.seconds, self.backwards = 0.0, 0
            self.stages = dict.fromkeys(STAGES, 0.0)
            return
        self.seconds -= step.seconds
        for stage, value in step.stages.items():
            self.stages[stage] -= value
        self.backwards -= step.backwards

    def quantile(self, q: float) -> float | None:
        return quantile_sorted(self.ordered, q) if self.ordered else None

    def span(self) -> float:
        """Seconds from the first step's start to the last one's end."""
        steps = self.steps
        return steps[-1].start + steps[-1].seconds - steps[0].start if steps else 0.0

    def shares(self) -> dict[str, float]:
        """Each stage's share of the window's step time ({} when it holds none)."""
        if self.seconds <= 0:
            return {}
        return {stage: max(0.0, self.stages.get(stage, 0.0)) / self.seconds for stage in STAGES}


def new_steps(ranks: Mapping[str, deque[Step]], after: float) -> dict[str, list[Step]]:
    """What ``match_arrivals(ranks, after)`` reads of each rank's steps: the reference
    rank's steps that began after ``after``, and the others' that could match one of them
    (those beginning within half the longest of them before), read from the newest back,
    so that each collect reads the steps since the last rather than the whole of ``recent``."""
    if len(ranks) < 2:
        return {rank: [] for rank in ranks}
    reference = min(ranks, key=_rank_order)
    fresh = _since(ranks[reference], lambda s: s.start > after)
    if not fresh:
        return {rank: [] for rank in ranks}
    reach = max(s.seconds for s in fresh) / 2
    out = {rank: _since(steps, lambda s: s.start >= after - reach) for rank, steps in ranks.items() if rank != reference}
    out[reference] = fresh
    return out


def _since(steps: deque[Step], keep: Callable[[Step], bool]) -> list[Step]:
    out = list(itertools.takewhile(keep, reversed(steps)))
    out.reverse()
    return out


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


class StepArrivals(NamedTuple):
    """One step's matched collectives, folded to what the straggler summary reads of them:
    a job's window keeps one of these a step, however many collectives the step calls."""

    start: float  # the reference rank's step start
    collectives: int
    first: float  # the earliest call of the step, any rank
    last: float  # the latest
    last_counts: Mapping[str, int]  # rank -> collectives it called last (by more than the tie)
    lag: Mapping[str, float]  # rank -> its lags added up (calls back to back once)
    median_lag: Mapping[str, float]  # rank -> its median lag over the step's collectives
    max_lag: Mapping[str, float]  # rank -> its largest lag of the step


def fold_steps(arrivals: Iterable[Arrival], tie: float = 50e-6, back_to_back: float = 1e-3) -> list[StepArrivals]:
    """The arrivals of each step folded into one ``StepArrivals``, in step order. A rank
    is last at a collective when it called it more than ``tie`` seconds after the
    runner-up. A step's lags are added up: FSDP calls a collective per layer, each late by
    a slice of the step, so one collective's lag understates what the others wait. A call
    that every rank made within ``back_to_back`` seconds of its previous one adds nothing:
    calls with no work between (one call hitting two probed functions, FSDP's gather of a
    layer's parameters in a few calls) are one wait."""
    by_step: dict[float, list[Arrival]] = {}
    for a in arrivals:
        by_step.setdefault(a.step_start, []).append(a)
    out = []
    for start in sorted(by_step):
        counts: dict[str, int] = {}
        lags: dict[str, list[float]] = {}
        total: dict[str, float] = {}
        before: Mapping[str, float] | None = None
        first, last = math.inf, -math.inf
        for a in sorted(by_step[start], key=lambda a: a.index):
            ordered = sorted(a.times.items(), key=lambda kv: kv[1])
            first, last = min(first, ordered[0][1]), max(last, ordered[-1][1])
            if len(ordered) >= 2 and ordered[-1][1] - ordered[-2][1] > tie:
                counts[ordered[-1][0]] = counts.get(ordered[-1][0], 0) + 1
            now = a.lags()
            for rank, lag in now.items():
                lags.setdefault(rank, []).append(lag)
            if before is None or any(t - before.get(rank, -math.inf) > back_to_back for rank, t in a.times.items()):
                for rank, lag in now.items():
                    total[rank] = total.get(rank, 0.0) + lag
            before = a.times
        out.append(StepArrivals(start, len(by_step[start]), first, last, counts, total,
                                {r: quantile(v, 0.5) for r, v in lags.items()}, {r: max(v) for r, v in lags.items()}))
    return out


@dataclass(frozen=True)
class LastArrivals:
    """Who arrived last, over a window of matched collectives of one job."""

    collectives: int
    last_counts: Mapping[str, int]  # rank -> collectives at which it was last
    median_lag: Mapping[str, float]  # rank -> its median lag behind the first, at the median step
    step_seconds: float  # median step time of the job over the window
    step_lag: Mapping[str, float]  # rank -> its lags of a step added up, at the median over steps
    steps: int = 0  # steps of the window
    step_last_counts: Mapping[str, int] = field(default_factory=dict)  # rank -> steps at which its lags added up most
    step_max_lag: Mapping[str, float] = field(default_factory=dict)  # rank -> its largest lag of a step, at the median step


def last_arrivals(arrivals: Sequence[Arrival], step_seconds: float, tie: float = 50e-6,
                  back_to_back: float = 1e-3) -> LastArrivals:
    """The summary of ``fold_steps(arrivals)``: see ``summarize``."""
    return summarize(fold_steps(arrivals, tie, back_to_back), step_seconds, tie)


def summarize(steps: Sequence[StepArrivals], step_seconds: float, tie: float = 50e-6) -> LastArrivals:
    """Count, per rank, the collectives it called last and the steps at which its lags
    added up most (by more than ``tie`` over the runner-up, so that ranks arriving together
    name no one), and take each rank's lags of a step added up at the median over steps.
    The step is what a straggler costs: where one collective a step re-aligns the ranks (HF
    ``Trainer`` gathers the batch's item count first thing), the straggler is late there by
    its whole lag and the collectives after it are a coin toss, so who is last at each
    collective understates it, and who lags most over the step does not."""
    counts: dict[str, int] = {}
    step_last: dict[str, int] = {}
    step_lag: dict[str, list[float]] = {}
    medians: dict[str, list[float]] = {}
    largest: dict[str, list[float]] = {}
    for s in steps:
        for rank, n in s.last_counts.items():
            counts[rank] = counts.get(rank, 0) + n
        for rank, lag in s.lag.items():
            step_lag.setdefault(rank, []).append(lag)
        for rank, lag in s.median_lag.items():
            medians.setdefault(rank, []).append(lag)
        for rank, lag in s.max_lag.items():
            largest.setdefault(rank, []).append(lag)
        ordered = sorted(s.lag.items(), key=lambda kv: kv[1])
        if len(ordered) >= 2 and ordered[-1][1] - ordered[-2][1] > tie:
            step_last[ordered[-1][0]] = step_last.get(ordered[-1][0], 0) + 1
    return LastArrivals(sum(s.collectives for s in steps), counts, {r: quantile(v, 0.5) for r, v in medians.items()},
                        step_seconds, {r: quantile(v, 0.5) for r, v in step_lag.items()}, len(steps), step_last,
                        {r: quantile(v, 0.5) for r, v in largest.items()})


class ArrivalWindow:
    """A job's folded steps of a sliding window with what ``summarize`` reads of them kept
    as steps come and go: ``summary()`` equals ``summarize(list(steps))`` at a cost per step
    rather than per summary (the window holds thousands of steps at 100 steps a second).
    Steps come in order of start, and the oldest leave first; at most ``cap`` are kept."""

    def __init__(self, cap: int, tie: float = 50e-6) -> None:
        self.cap = cap
        self.tie = tie
        self.steps: deque[StepArrivals] = deque()
        self.collectives = 0
        self.last_counts: dict[str, int] = {}
        self.step_last: dict[str, int] = {}
        # rank -> ascending values of the steps: lags added up, median lag, largest lag
        self.lags: tuple[dict[str, list[float]], ...] = ({}, {}, {})

    def add(self, step: StepArrivals) -> None:
        self.steps.append(step)
        self._count(step, 1)
        if len(self.steps) > self.cap:
            self._count(self.steps.popleft(), -1)

    def extend(self, steps: Iterable[StepArrivals]) -> None:
        for step in steps:
            self.add(step)

    def expire(self, since: float) -> None:
        """Let go of the steps that began before ``since``."""
        steps = self.steps
        while steps and steps[0].start < since:
            self._count(steps.popleft(), -1)

    def _count(self, s: StepArrivals, sign: int) -> None:
        self.collectives += sign * s.collectives
        for rank, n in s.last_counts.items():
            _tally(self.last_counts, rank, sign * n)
        ordered = sorted(s.lag.items(), key=lambda kv: kv[1])
        if len(ordered) >= 2 and ordered[-1][1] - ordered[-2][1] > self.tie:
            _tally(self.step_last, ordered[-1][0], sign)
        for values, per_rank in zip(self.lags, (s.lag, s.median_lag, s.max_lag), strict=True):
            for rank, lag in per_rank.items():
                kept = values.setdefault(rank, [])
                if sign > 0:
                    bisect.insort(kept, lag)
                else:
                    del kept[bisect.bisect_left(kept, lag)]
                    if not kept:
                        del values[rank]

    def summary(self, step_seconds: float) -> LastArrivals:
        step_lag, medians, largest = ({r: quantile_sorted(v, 0.5) for r, v in values.items()} for values in self.lags)
        return LastArrivals(self.collectives, dict(self.last_counts), medians, step_seconds, step_lag,
                            len(self.steps), dict(self.step_last), largest)


def _tally(counts: dict[str, int], key: str, by: int) -> None:
    value = counts.get(key, 0) + by
    if value:
        counts[key] = value
    else:
        counts.pop(key, None)


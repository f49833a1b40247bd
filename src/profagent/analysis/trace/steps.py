"""Steps: the CPU ``ProfilerStep#N`` ranges, as the profiler recorded them.

A step is its CPU range ``[start, end)``: the time between two ``prof.step()`` calls, the
period a steady job repeats. Steps are not extended to the GPU work they launched: on a
GPU-bound job the device runs behind the CPU by a roughly constant lag, so extending the
steps would give the first step the whole lag (and shift every later step), while the
CPU ranges of a steady job come out equal. The GPU work still running when the last
analysed step ends is reported apart as ``gpu_lag`` (seconds), not added to any step.

Kept and dropped ranges:

- two ranges with the same name at different times are two steps (both kept);
- a range inside an earlier kept one (the same step recorded twice, e.g. as
  ``user_annotation`` and ``cpu_op``, or a nested ``ProfilerStep``) is not a step;
- a range that overlaps the previous step starts where that step ends;
- a range of zero or negative length is dropped (``dropped``);
- the last range is ``incomplete`` (the profiler stopped right after ``prof.step()``
  opened it) and excluded when every step before it contains an optimizer step (an
  ``Optimizer.step#...`` range, recorded by torch for every optimizer) and it does not;
  in a trace without optimizer ranges, when it is shorter than half the shortest step
  before it. E.g. ``mi250-rocm``: a 49 µs ``ProfilerStep#2`` with no ``Optimizer.step``
  after a 9.29 ms ``ProfilerStep#1`` that has one.

Without ``ProfilerStep`` (an on-demand trace taken through Kineto's daemon has none), the
optimizer steps mark the iterations: torch records an ``Optimizer.step#<Class>.step``
range for every optimizer step, so with N of them (of the most frequent such name) there
are N-1 steps, each from one optimizer step's start to the next one's (``source`` is
``optimizer``). The span before the first one is left out: a window taken for a duration
starts anywhere in an iteration. A window taken for N iterations
(``ACTIVITIES_ITERATIONS=N``, ``iteration_window``) is different: libkineto starts it at an
iteration boundary (the ``step()`` that follows an optimizer step) and stops it at the N-th
``step()`` after, so it holds N optimizer steps and N whole iterations; the first step
then runs from the window's start to the first optimizer step. ``step()`` runs inside the
optimizer step's range, and the window ends there (the trace's ``Record Window End``,
``Trace.window_end``), but libkineto stops torch's recording on another thread while the
job goes on: on a loaded node the trace held 7 optimizer steps for N = 2. Optimizer steps
that start after the window's end are not the window's. Without either, the whole traced
window (first to last kept event) is one span, and ``inferred`` is True: a window is not a
step time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from profagent.analysis.trace.intervals import unique
from profagent.analysis.trace.kinds import Classified

INCOMPLETE_SHARE = 0.5  # without optimizer ranges: shorter than this share of the shortest
OPTIMIZER_PREFIX = "Optimizer.step#"


@dataclass(frozen=True)
class Step:
    name: str
    start: float  # µs
    end: float  # µs, end of the CPU range

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Steps:
    steps: tuple[Step, ...]
    inferred: bool  # True: no ProfilerStep in the trace; one span covers the window
    incomplete: tuple[Step, ...] = ()  # excluded: the profiler stopped inside them
    dropped: int = 0  # ranges of zero or negative length
    gpu_lag: float | None = None  # µs of device work launched in the last step, after its end
    source: str = "profiler_step"  # profiler_step, optimizer, or window (inferred)

    @property
    def spans(self) -> list[tuple[float, float]]:
        return [(s.start, s.end) for s in self.steps]


def find_steps(c: Classified, iteration_window: bool = False) -> Steps:
    """Steps of one trace (empty when the trace has no events at all). ``iteration_window``:
    the trace was taken for a number of iterations (see the module doc)."""
    t = c.trace
    idx = c.steps[np.lexsort((-t.end[c.steps], t.ts[c.steps]))]  # by start, longest first
    kept: list[Step] = []
    dropped = 0
    for i in idx.tolist():
        start, end = float(t.ts[i]), float(t.end[i])
        if not end > start:  # also NaN
            dropped += 1
            continue
        if kept and end <= kept[-1].end:
            continue  # the same step recorded twice, or a nested ProfilerStep
        if kept and start < kept[-1].end:
            start = kept[-1].end
        kept.append(Step(t.names[t.name[i]], start, end))
    if not kept:
        by_optimizer = _optimizer_steps(c, iteration_window)
        if len(by_optimizer) >= 1:
            return Steps(by_optimizer, False, dropped=dropped, gpu_lag=_gpu_lag(c, by_optimizer[-1]),
                         source="optimizer")
        whole = _whole_window(c)
        return Steps(whole.steps, whole.inferred, dropped=dropped, source="window")
    incomplete: tuple[Step, ...] = ()
    if len(kept) >= 2 and _is_incomplete(c, kept):
        incomplete = (kept.pop(),)
    return Steps(tuple(kept), False, incomplete, dropped, _gpu_lag(c, kept[-1]))


def _optimizer_steps(c: Classified, iteration_window: bool = False) -> tuple[Step, ...]:
    """Iterations between consecutive optimizer steps (the most frequent optimizer name);
    with ``iteration_window``, the first from the window's start."""
    t = c.trace
    idx = np.concatenate([c.annotations, c.cpu_ops])
    if len(idx) == 0:
        return ()
    opt = np.array([n.startswith(OPTIMIZER_PREFIX) for n in t.names] or [False], dtype=bool)
    idx = idx[opt[t.name[idx]]]
    if len(idx) < (1 if iteration_window else 2):
        return ()
    names, counts = np.unique(t.name[idx], return_counts=True)
    top = names[np.argmax(counts)]
    starts = unique(t.ts[idx[t.name[idx] == top]])  # sorted; a range recorded twice counts once
    window_start = float(t.ts.min())
    if iteration_window:
        if t.window_end is not None and t.window_end > window_start:
            starts = starts[starts < t.window_end]  # the rest ran while libkineto stopped the profiler
        if len(starts) and window_start < starts[0]:
            starts = np.concatenate([[window_start], starts])
    return tuple(Step(f"iteration {k + 1}", float(a), float(b))
                 for k, (a, b) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True)))


def _is_incomplete(c: Classified, steps: list[Step]) -> bool:
    """Whether the last step is a stub the profiler stopped in (see the module doc)."""
    t = c.trace
    idx = np.concatenate([c.annotations, c.cpu_ops])
    opt = np.array([n.startswith(OPTIMIZER_PREFIX) for n in t.names] or [False], dtype=bool)
    marks = t.ts[idx[opt[t.name[idx]]]] if len(idx) else np.empty(0)
    has = [bool(((marks >= s.start) & (marks < s.end)).any()) for s in steps]
    if all(has[:-1]):
        return not has[-1]
    return steps[-1].duration < INCOMPLETE_SHARE * min(s.duration for s in steps[:-1])


def _gpu_lag(c: Classified, last: Step) -> float | None:
    """µs between the last step's end and the end of the device work it launched."""
    launch = c.gpu_launch
    inside = (launch >= last.start) & (launch < last.end)
    if not inside.any():
        return None
    return max(0.0, float(c.trace.end[c.gpu][inside].max()) - last.end)


def _whole_window(c: Classified) -> Steps:
    t = c.trace
    if len(t) == 0:
        return Steps((), inferred=True)
    lo, hi = float(t.ts.min()), float(t.end.max())
    if not hi > lo:
        return Steps((), inferred=True)
    return Steps((Step("window", lo, hi),), inferred=True)

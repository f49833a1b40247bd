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
- the last range is ``incomplete`` when it is shorter than half the median of the
  steps before it: the profiler stopped right after ``prof.step()`` opened it (e.g. a
  49 µs ``ProfilerStep#2`` after a 9.29 ms ``ProfilerStep#1``). It is excluded.

Without ``ProfilerStep`` events the whole traced window (first to last kept event) is
one span, and ``inferred`` is True.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from profagent.analysis.trace.kinds import Classified

INCOMPLETE_SHARE = 0.5  # a last step shorter than this share of the median is incomplete


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

    @property
    def spans(self) -> list[tuple[float, float]]:
        return [(s.start, s.end) for s in self.steps]


def find_steps(c: Classified) -> Steps:
    """Steps of one trace (empty when the trace has no events at all)."""
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
        whole = _whole_window(c)
        return Steps(whole.steps, whole.inferred, dropped=dropped)
    incomplete: tuple[Step, ...] = ()
    if len(kept) >= 2:
        median = float(np.median([s.duration for s in kept[:-1]]))
        if kept[-1].duration < INCOMPLETE_SHARE * median:
            incomplete = (kept.pop(),)
    return Steps(tuple(kept), False, incomplete, dropped, _gpu_lag(c, kept[-1]))


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

"""Steps: the CPU ``ProfilerStep#N`` ranges, as the profiler recorded them (not extended
to the GPU work they launched: that lag is ``gpu_lag``, apart); without them, the
optimizer steps mark the iterations; without either, the traced window is one span
(``inferred``). Which ranges are kept, which dropped and why: docs/traces.md (How steps
are found).
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

"""Steps: ``ProfilerStep#N`` ranges, extended to the end of the GPU work they launched.

A step starts at its CPU range's start and ends at the later of its CPU end and the end
of the last GPU op (kernel, memcpy, memset) whose launching runtime call (matched by
``correlation``) started inside the step's CPU range. Steps then tile time without
overlap: a step starts no earlier than the previous step's (extended) end.

Without ``ProfilerStep`` events the whole traced window (first to last kept event) is
one span, and ``inferred`` is True.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from profagent.analysis.trace.kinds import Classified


@dataclass(frozen=True)
class Step:
    name: str
    start: float  # µs
    end: float  # µs, extended to the GPU work launched in the step
    cpu_end: float  # µs, end of the CPU range

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Steps:
    steps: tuple[Step, ...]
    inferred: bool  # True: no ProfilerStep in the trace; one span covers the window

    @property
    def spans(self) -> list[tuple[float, float]]:
        return [(s.start, s.end) for s in self.steps]


def find_steps(c: Classified) -> Steps:
    """Steps of one trace (empty when the trace has no events at all)."""
    t = c.trace
    raw: dict[str, tuple[float, float]] = {}
    for i in c.steps[np.argsort(t.ts[c.steps], kind="stable")]:
        raw.setdefault(t.names[t.name[i]], (float(t.ts[i]), float(t.end[i])))
    if not raw:
        return _whole_window(c)
    ordered = sorted(raw.items(), key=lambda kv: kv[1][0])
    starts = np.array([s for _, (s, _) in ordered])
    cpu_ends = np.array([e for _, (_, e) in ordered])
    ends = cpu_ends.copy()
    launch = c.gpu_launch
    matched = ~np.isnan(launch)
    which = np.searchsorted(starts, launch[matched], side="right") - 1
    op_end = t.end[c.gpu][matched]
    ok = which >= 0
    ok[ok] = launch[matched][ok] < cpu_ends[which[ok]]
    np.maximum.at(ends, which[ok], op_end[ok])
    steps: list[Step] = []
    prev_end = float("-inf")
    for (name, (start, cpu_end)), end in zip(ordered, ends.tolist(), strict=True):
        start = max(start, prev_end)
        end = max(end, start)
        steps.append(Step(name, start, end, cpu_end))
        prev_end = end
    return Steps(tuple(steps), inferred=False)


def _whole_window(c: Classified) -> Steps:
    t = c.trace
    if len(t) == 0:
        return Steps((), inferred=True)
    lo, hi = float(t.ts.min()), float(t.end.max())
    if hi <= lo:
        return Steps((), inferred=True)
    return Steps((Step("window", lo, hi, hi),), inferred=True)

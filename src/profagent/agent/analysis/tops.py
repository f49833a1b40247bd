"""Top-K: ops by self CPU time, kernels by GPU time. Everything else folds into "other".

Self CPU time of an op = its duration minus the durations of the ops directly nested in
it on the same thread (as torch.profiler's "Self CPU"). Kernel time = the sum of the
kernel's durations (not a union: two streams running the same kernel count twice).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from profagent.agent.analysis.kinds import Classified
from profagent.agent.traceio import KERNEL

OTHER = "other"


@dataclass(frozen=True)
class Top:
    name: str
    time: float  # µs
    count: int


def _rank(names: list[str], times: np.ndarray, counts: np.ndarray, k: int) -> tuple[Top, ...]:
    present = np.flatnonzero(counts > 0)
    order = present[np.lexsort((present, -times[present]))]
    out = [Top(names[i], float(times[i]), int(counts[i])) for i in order[:k]]
    rest = order[k:]
    if len(rest):
        out.append(Top(OTHER, float(times[rest].sum()), int(counts[rest].sum())))
    return tuple(out)


def top_ops(c: Classified, k: int) -> tuple[Top, ...]:
    """Ops by self CPU time (µs), K largest then "other"."""
    t = c.trace
    ops = c.cpu_ops
    start, end, thread = t.ts[ops], t.end[ops], t.thread[ops]
    # nesting per thread: sort by (thread, start, longest first) and walk a stack
    order = np.lexsort((start - end, start, thread))
    starts, ends = start[order].tolist(), end[order].tolist()
    bounds = np.flatnonzero(np.diff(thread[order])) + 1
    self_time = (end[order] - start[order]).tolist()
    for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), len(order)], strict=True):
        stack: list[int] = []
        pop, push = stack.pop, stack.append
        for j in range(lo, hi):
            s = starts[j]
            while stack and ends[stack[-1]] <= s:
                pop()
            if stack:
                p = stack[-1]
                e, pe = ends[j], ends[p]
                self_time[p] -= (e if e < pe else pe) - s
            push(j)
    names = t.name[ops][order]
    n = len(t.names)
    times = np.bincount(names, weights=np.maximum(np.array(self_time), 0.0), minlength=n)
    counts = np.bincount(names, minlength=n)
    return _rank(t.names, times, counts, k)


def top_kernels(c: Classified, k: int) -> tuple[Top, ...]:
    """Kernels by summed GPU time (µs), K largest then "other"."""
    t = c.trace
    kernels = c.gpu[t.kind[c.gpu] == KERNEL]
    n = len(t.names)
    times = np.bincount(t.name[kernels], weights=t.end[kernels] - t.ts[kernels], minlength=n)
    counts = np.bincount(t.name[kernels], minlength=n)
    return _rank(t.names, times, counts, k)

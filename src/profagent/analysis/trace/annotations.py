"""record_function ranges (``user_annotation`` on the CPU) as per-name durations.

These are the stage timings people otherwise write by hand (``forward``, ``backward``,
custom names, plus torch's own ``Optimizer.step#...`` and ``nccl:...``). ProfilerStep
ranges are reported by the steps analyzer instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from profagent.analysis.trace.intervals import unique
from profagent.analysis.trace.kinds import Classified


@dataclass(frozen=True)
class Annotation:
    name: str
    total: float  # µs, summed over occurrences
    count: int


def annotations(c: Classified) -> tuple[Annotation, ...]:
    """Per-name totals, largest first."""
    t = c.trace
    idx = c.annotations
    n = len(t.names)
    totals = np.bincount(t.name[idx], weights=t.end[idx] - t.ts[idx], minlength=n)
    counts = np.bincount(t.name[idx], minlength=n)
    present = np.flatnonzero(counts > 0)
    order = present[np.lexsort((present, -totals[present]))]
    return tuple(Annotation(t.names[i], float(totals[i]), int(counts[i])) for i in order)


def annotation_gpu_time(c: Classified) -> dict[str, float]:
    """Per annotation name: µs of GPU work launched inside its ranges, summed over the GPU
    ops (not a union) whose runtime call starts inside a range of that name on the same
    thread. Ranges of one name nested in each other count their work once per range."""
    t = c.trace
    matched = np.flatnonzero(c.gpu_launcher >= 0)
    idx = c.annotations
    if not len(matched) or not len(idx):
        return {}
    calls = c.gpu_launcher[matched]
    dur = t.end[c.gpu[matched]] - t.ts[c.gpu[matched]]
    out: dict[str, float] = {}
    call_thread = t.thread[calls]
    for th in unique(t.thread[idx]).tolist():
        on = call_thread == th
        if not on.any():
            continue
        order = np.argsort(t.ts[calls[on]], kind="stable")
        ts = t.ts[calls[on]][order]
        cum = np.concatenate([[0.0], np.cumsum(dur[on][order])])
        ann = idx[t.thread[idx] == th]
        lo = np.searchsorted(ts, t.ts[ann], side="left")
        hi = np.searchsorted(ts, t.end[ann], side="left")
        sums = np.bincount(t.name[ann], weights=cum[hi] - cum[lo], minlength=len(t.names))
        for i in np.flatnonzero(sums > 0).tolist():
            out[t.names[i]] = out.get(t.names[i], 0.0) + float(sums[i])
    return out

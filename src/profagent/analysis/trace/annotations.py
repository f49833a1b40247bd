"""record_function ranges (``user_annotation`` on the CPU) as per-name durations.

These are the stage timings people otherwise write by hand (``forward``, ``backward``,
custom names, plus torch's own ``Optimizer.step#...`` and ``nccl:...``). ProfilerStep
ranges are reported by the steps analyzer instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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

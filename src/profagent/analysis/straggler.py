"""The one straggler rule, shared by the live ``straggler`` finding and ``profagent analyze``:
a rank whose wait is far below the median of the other ranks' waits (see docs/diagnosis.md,
"The straggler rule"). Each caller passes its own measure of wait and its own bounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


def median(values: list[float]) -> float:
    """(statistics imports decimal and fractions: milliseconds on every `analyze`.)"""
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


@dataclass(frozen=True)
class LowWait:
    """One rank's wait against the median of the others', and whether the rule names it."""

    rank: str
    wait: float
    others_median: float
    gap: float  # others_median - wait
    shortfall: float  # gap / others_median (0 when the others do not wait)
    named: bool


def judge(waits: Mapping[str, float], rank: str, min_gap: float, min_shortfall: float,
          gap_strict: bool = False) -> LowWait:
    """``rank`` (one of at least two in ``waits``) against the others' median: named when
    its wait is below it by at least ``min_gap`` (more than, with ``gap_strict``) and by
    at least ``min_shortfall`` of it."""
    others = median([w for r, w in waits.items() if r != rank])
    gap = others - waits[rank]
    shortfall = gap / others if others > 0 else 0.0
    far = gap > min_gap if gap_strict else gap >= min_gap
    return LowWait(rank, waits[rank], others, gap, shortfall, far and shortfall >= min_shortfall)


def low_waiters(waits: Mapping[str, float], min_gap: float, min_shortfall: float,
                gap_strict: bool = False) -> list[LowWait]:
    """Every rank the rule names, in the order of ``waits`` (none with fewer than two ranks)."""
    if len(waits) < 2:
        return []
    judged = (judge(waits, rank, min_gap, min_shortfall, gap_strict) for rank in waits)
    return [j for j in judged if j.named]

"""The one straggler rule, shared by the live ``straggler`` finding and ``profagent analyze``:
a rank whose wait is far below the median of the other ranks' waits (see docs/diagnosis.md,
"The straggler rule"). Each caller passes its own measure of wait and its own bounds.
And which of the step timeline's stages explains a straggler's lag (``stage_cause``).
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


# -- the straggler's cause, from the step timeline's stages --------------------------------

CAUSE_STAGES = ("data_wait", "backward", "optimizer", "other")
# A stage explains a straggler's lag when its share of the straggler's step is above the
# others' median by at least this (absolute: shares compare as times, every rank's step
# being as long in a synchronous job)...
CAUSE_MIN_EXCESS = 0.03
# ...holds at least this part of what the straggler spends more than the others (the sum
# of its stages above theirs: the others spend the rest waiting for it, in the stage their
# collective is in)...
CAUSE_PART = 0.5
# ...and is more above theirs, in proportion, by at least this factor than any other stage
# it spends more in: a rank slower all through (a slower device, a busy node) takes the
# same factor longer in each stage, and no one stage explains it.
CAUSE_STANDS_OUT = 2.0


@dataclass(frozen=True)
class StageCause:
    """A straggler's stage shares against the others' medians, and the stage that explains
    its lag ("" where none does)."""

    stage: str
    shares: Mapping[str, float]  # its share of a step, per stage
    others: Mapping[str, float]  # the other ranks' median share, per stage


def stage_cause(shares: Mapping[str, Mapping[str, float]], rank: str) -> StageCause | None:
    """Which stage of ``rank``'s steps explains its lag: the one it spends the most more in
    than the others' median, where that is at least ``CAUSE_MIN_EXCESS`` of a step,
    ``CAUSE_PART`` of all it spends more, and ``CAUSE_STANDS_OUT`` times any other such
    stage's excess in proportion. None without the stages of ``rank`` and another rank."""
    mine = shares.get(rank)
    others = [s for r, s in shares.items() if r != rank and s]
    if not mine or not others:
        return None
    medians = {stage: median([s.get(stage, 0.0) for s in others]) for stage in CAUSE_STAGES}
    excess = {stage: mine.get(stage, 0.0) - medians[stage] for stage in CAUSE_STAGES}
    more = {stage: e for stage, e in excess.items() if e > 0}
    stage = max(CAUSE_STAGES, key=lambda st: excess[st])

    def proportion(st: str) -> float:
        return excess[st] / max(medians[st], 0.01)

    explains = (excess[stage] >= CAUSE_MIN_EXCESS and excess[stage] >= CAUSE_PART * sum(more.values())
                and all(proportion(stage) >= CAUSE_STANDS_OUT * proportion(st)
                        for st in more if st != stage and more[st] >= 0.01))
    return StageCause(stage if explains else "", {st: mine.get(st, 0.0) for st in CAUSE_STAGES}, medians)

"""``hang``: stalled ranks, and the rank that holds the others up.

Input: each rank's ``RankStall`` from the stacks source (stalled or not, and the main
thread's current stack, root first). In a collective every rank must arrive: ranks whose
stack is inside ``torch/distributed`` wait; a rank that is not there is the culprit. When
every rank this agent sees waits in the same collective, the rank holding them up is
elsewhere (another node) or the network is stuck.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from profagent.analysis.findings import Finding
from profagent.analysis.stacks import Frame

_COLLECTIVE_FILES = ("torch/distributed/",)
STACK_EVIDENCE_FRAMES = 12  # innermost frames kept per rank in the evidence


def _in_collective(frames: Sequence[Frame]) -> bool:
    return any(any(p in f.file for p in _COLLECTIVE_FILES) for f in frames)


def collective_call(frames: Sequence[Frame]) -> tuple[Frame | None, Frame | None]:
    """(the innermost torch.distributed frame, the frame that called into torch.distributed)."""
    first = next((i for i, f in enumerate(frames) if any(p in f.file for p in _COLLECTIVE_FILES)), None)
    if first is None:
        return None, None
    inner = next(f for f in reversed(frames) if any(p in f.file for p in _COLLECTIVE_FILES))
    return inner, frames[first - 1] if first > 0 else None


def _where(f: Frame | None) -> str:
    return "?" if f is None else f"{f.name} ({f.file}:{f.line})"


def _stack_lines(frames: Sequence[Frame]) -> list[str]:
    return [str(f) for f in frames[-STACK_EVIDENCE_FRAMES:]]


def _ranks(ranks: Iterable[str]) -> str:
    items = sorted(ranks, key=lambda r: (len(r), r))
    return ("rank " if len(items) == 1 else "ranks ") + ", ".join(items)


def hang(stalls: Iterable[Any], job_id: str) -> list[Finding]:
    """Findings of one job from its ranks' ``RankStall`` (rank, stalled, unchanged_seconds, frames)."""
    rows = [s for s in stalls if s.job_id == job_id and s.frames]
    stalled = [s for s in rows if s.stalled]
    if not stalled:
        return []
    waiting = [s for s in rows if _in_collective(s.frames)]
    stalled_waiting = [s for s in waiting if s.stalled]
    stacks = {s.rank: _stack_lines(s.frames) for s in rows}
    seconds = max(s.unchanged_seconds for s in stalled)
    evidence: dict[str, Any] = {
        "stalled_ranks": sorted((s.rank for s in stalled), key=lambda r: (len(r), r)),
        "unchanged_seconds": round(seconds, 1),
        "stacks": stacks,
    }
    if not stalled_waiting:  # stalled outside any collective: each rank on its own
        return [Finding(
            "hang", job_id, s.rank, "critical",
            f"rank {s.rank} is stuck at {_where(s.frames[-1])} (stack unchanged for {s.unchanged_seconds:.0f} s, "
            "not in a collective): a deadlock, a blocking read or an endless loop",
            {**evidence, "culprit_ranks": [s.rank], "location": _where(s.frames[-1])},
        ) for s in stalled]

    calls = {s.rank: collective_call(s.frames) for s in waiting}
    collective, caller = calls[stalled_waiting[0].rank]
    culprits = [s for s in rows if not _in_collective(s.frames)]
    evidence.update({
        "waiting_ranks": sorted((s.rank for s in waiting), key=lambda r: (len(r), r)),
        "collective": _where(collective),
        "called_at": _where(caller),
    })
    if culprits:
        parts = "; ".join(f"rank {c.rank} at {_where(c.frames[-1])}" for c in culprits)
        evidence["culprit_ranks"] = [c.rank for c in culprits]
        evidence["culprit_locations"] = {c.rank: _where(c.frames[-1]) for c in culprits}
        return [Finding(
            "hang", job_id, culprits[0].rank if len(culprits) == 1 else None, "critical",
            f"{_ranks(s.rank for s in waiting)} wait in {_where(collective)} for {seconds:.0f} s; "
            f"the culprit is not in it: {parts}",
            evidence,
        )]
    distinct = {(_where(c), _where(k)) for c, k in calls.values()}
    if len(distinct) == 1:
        return [Finding(
            "hang", job_id, None, "critical",
            f"every rank seen here ({', '.join(evidence['waiting_ranks'])}) waits in {_where(collective)} "
            f"called at {_where(caller)} for {seconds:.0f} s: the rank holding it up is on another node, "
            "or the network is stuck",
            {**evidence, "culprit_ranks": []},
        )]
    per_rank = "; ".join(f"rank {r} in {_where(c)} called at {_where(k)}" for r, (c, k) in sorted(calls.items()))
    return [Finding(
        "hang", job_id, None, "critical",
        f"ranks wait in different collectives for {seconds:.0f} s (mismatched collective order): {per_rank}",
        {**evidence, "culprit_ranks": [], "collectives": {r: _where(c) for r, (c, _) in calls.items()}},
    )]

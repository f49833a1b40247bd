"""``hang``: stalled ranks, and the rank that holds the others up. One finding per job.

Input: each rank's ``RankStall`` from the stacks source (stalled or not, the main thread's
current stack, and the same stack with native frames when a native window caught it).
In a collective every rank must arrive: a rank whose stack is in the collective layer
(Python ``torch.distributed``, or native frames: DDP's reducer, ``Work::wait``, gloo,
NCCL; see analysis/collectives.py) is a victim; a rank that is not is the culprit.
When every rank this agent sees waits in the same collective, the rank holding them up
is elsewhere (another node) or the network is stuck; in different collectives, the
ranks took different paths (a collective mismatch).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from profagent.analysis.collectives import CollectiveWait, collective_wait, python_frames
from profagent.analysis.findings.inputs import AnalysisInputs
from profagent.contracts import Finding, Frame, RankStall

STACK_EVIDENCE_FRAMES = 12  # innermost frames kept per rank in the evidence


def _where(f: Frame | None) -> str:
    return "?" if f is None else str(f)


def _location(f: Frame | None) -> str:
    """``file:line`` of a frame (a native frame: its name), "?" when unknown."""
    if f is None:
        return "?"
    return f"{f.file}:{f.line}" if f.file else f.name


def _stack_lines(frames: Sequence[Frame]) -> list[str]:
    return [str(f) for f in frames[-STACK_EVIDENCE_FRAMES:]]


def _order(ranks: Iterable[str]) -> list[str]:
    return sorted(ranks, key=lambda r: (len(r), r))


def _ranks(ranks: Iterable[str], verb: tuple[str, str] = ("", "")) -> str:
    """"rank 0 waits" / "ranks 0, 2 wait" (verb = (singular, plural))."""
    items = _order(ranks)
    one = len(items) == 1
    text = ("rank " if one else "ranks ") + ", ".join(items)
    return f"{text} {verb[0] if one else verb[1]}" if verb[0] else text


def _in(w: CollectiveWait | None) -> str:
    if w is None:
        return "?"
    return w.describe() + (f" called at {w.called_at}" if w.called_at is not None else "")


def _here(s: RankStall) -> Frame | None:
    python = python_frames(s.frames)
    return python[-1] if python else (s.frames[-1] if s.frames else None)


def _native_may_change_its_role(s: RankStall, wait: CollectiveWait | None, settled: bool) -> bool:
    """Wait for native frames on their way that may change a rank's role: a stalled rank's
    first ones (a collective in C++, DDP's reducer, makes it a victim); before the first
    verdict (``settled`` False), those of any rank not stalled: while py-spy reads a native
    window (seconds, far more on a loaded node) its rank's stack is not updated, so it may
    show the rank from before the others stopped. A stalled rank's later native windows
    (every stall_seconds / 2; under load one after the other) are not waited for."""
    if not s.native_pending:
        return False
    if s.stalled:
        return wait is None and not s.native
    return not settled


def hang(stalls: Iterable[RankStall], job_id: str, settled: bool = False) -> list[Finding]:
    """The job's ``hang`` finding (at most one) from its ranks' ``RankStall``. ``settled``:
    the job had one at the last evaluation (it is not held back again for native frames)."""
    rows = sorted((s for s in stalls if s.job_id == job_id and s.frames), key=lambda s: (len(s.rank), s.rank))
    stalled = [s for s in rows if s.stalled]
    if not stalled:
        return []
    waits = {s.rank: collective_wait(s.native or s.frames) for s in rows}
    if any(_native_may_change_its_role(s, waits[s.rank], settled) for s in rows):
        return []
    if not settled and any(s.stale for s in rows):  # a rank shown from before the job stopped
        return []
    waiting = [s for s in rows if waits[s.rank] is not None]
    culprits = [s for s in rows if waits[s.rank] is None]
    seconds = max(s.unchanged_seconds for s in stalled)
    roles = {s.rank: {
        "role": "waiting" if waits[s.rank] else "culprit", "stalled": s.stalled,
        "at": _where(_here(s)), "collective": _in(waits[s.rank]) if waits[s.rank] else None,
        "native_frames": bool(s.native),
        # where it is (a waiting rank: the user's line that called the collective), for the
        # profagent_hang_rank_info series that rules join across nodes
        "location": _location((w.called_at or _here(s)) if (w := waits[s.rank]) else _here(s)),
    } for s in rows}
    evidence: dict[str, Any] = {
        "stalled_ranks": _order(s.rank for s in stalled),
        "unchanged_seconds": round(seconds, 1),
        "roles": roles,
        "waiting_ranks": _order(s.rank for s in waiting),
        "culprit_ranks": _order(s.rank for s in culprits),
        "stacks": {s.rank: _stack_lines(s.native or s.frames) for s in rows},
    }
    if waiting:
        first = waits[next((s for s in waiting if s.stalled), waiting[0]).rank]
        evidence["collective"] = first.describe() if first else "?"
        evidence["called_at"] = _where(first.called_at if first else None)
        evidence["collectives"] = {s.rank: _in(waits[s.rank]) for s in waiting}

    def finding(rank: str | None, diagnosis: str, summary: str) -> list[Finding]:
        return [Finding("hang", job_id, rank, "critical", summary, {**evidence, "diagnosis": diagnosis})]

    # a rank standing still in a collective (stalled, or for a whole window) waits for the
    # culprit even before its own stall_seconds are over
    if not any(waits[s.rank] and (s.stalled or s.suspected) for s in rows):  # stuck outside any collective
        stuck = stalled
        for key in ("collective", "called_at", "collectives"):
            evidence.pop(key, None)
        evidence["waiting_ranks"] = []
        evidence["culprit_ranks"] = _order(s.rank for s in stuck)
        evidence["culprit_locations"] = {s.rank: _where(_here(s)) for s in stuck}
        at = "; ".join(f"rank {s.rank} at {_where(_here(s))}" for s in stuck)
        return finding(stuck[0].rank if len(stuck) == 1 else None, "stuck",
                       f"{_ranks((s.rank for s in stuck), ('is', 'are'))} stuck, not in a collective "
                       f"(stack unchanged for {seconds:.0f} s): {at}: a deadlock, a blocking read or an endless loop")
    if culprits:
        evidence["culprit_locations"] = {c.rank: _where(_here(c)) for c in culprits}
        at = "; ".join(f"rank {c.rank} at {_where(_here(c))}" for c in culprits)
        victims = "; ".join(f"{_ranks([s.rank], ('waits', 'wait'))} in {_in(waits[s.rank])}" for s in waiting)
        return finding(culprits[0].rank if len(culprits) == 1 else None, "culprit",
                       f"{_ranks((c.rank for c in culprits), ('holds', 'hold'))} the job up, not in a collective: {at}. "
                       f"The others wait for {seconds:.0f} s: {victims}")
    distinct = {_in(w) for w in waits.values()}
    if len(distinct) == 1:
        return finding(None, "all_waiting",
                       f"every rank seen here ({', '.join(evidence['waiting_ranks'])}) waits in {_in(first)} "
                       f"for {seconds:.0f} s: the rank holding it up is on another node, or the network is stuck")
    per_rank = "; ".join(f"rank {s.rank} waits in {_in(waits[s.rank])}" for s in waiting)
    return finding(None, "collective_mismatch",
                   f"collective mismatch for {seconds:.0f} s: the ranks wait in different collectives, "
                   f"a collective skipped or reordered on some ranks: {per_rank}")


def analyze(inputs: AnalysisInputs) -> list[Finding]:
    """The first phase: a hang per job with stalled ranks. A job with a hang at the last
    evaluation is ``settled`` (its verdict stays put while the stacks stand still)."""
    out: list[Finding] = []
    for job in sorted({s.job_id for s in inputs.stalls}):
        out += hang(inputs.stalls, job, settled=job in inputs.was_hung)
    return out

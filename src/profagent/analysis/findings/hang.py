"""``hang``: stalled ranks, and the rank that holds the others up. One finding per job.

Ranks waiting in a collective are victims; a stalled rank that is not in one is the
culprit (how each case is told apart: the comment above ``hang``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from profagent.analysis.collectives import CollectiveWait, collective_wait
from profagent.analysis.findings.inputs import AnalysisInputs
from profagent.analysis.stacks import innermost_python, own_frame
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
    """The rank's own line: the innermost frame of the job's code, else the innermost Python frame."""
    return own_frame(s.frames) or innermost_python(s.frames) or (s.frames[-1] if s.frames else None)


def _frames_here(frames: Sequence[Frame]) -> str:
    return _where(own_frame(frames) or innermost_python(frames) or (frames[-1] if frames else None))


# The collectives a rank calls once its training loop is over; "all_reduce" only outside backward.
END_OF_LOOP = ("barrier", "monitored_barrier", "destroy_process_group", "all_reduce")

ADVICE = {
    "stuck": ("look at that line (a deadlock, a blocking read, an endless loop): `py-spy dump --pid PID` "
              "shows every thread; a rank stuck outside collectives stops the job at its next collective"),
    "culprit": ("look at the culprit's line: the other ranks wait for it at their next collective; if it "
                "blocks on I/O or a lock, fix that; if it only runs slower, the others' timeout "
                "(TORCH_NCCL/gloo timeout) ends the job"),
    "worker": ("a DataLoader worker hangs in the dataset at that line (a blocking read, a lock, a network "
               "call, an endless loop): fix that line; DataLoader(timeout=seconds) makes a stuck worker raise "
               "instead of hanging the job; more workers do not help"),
    "all_waiting": ("look at the ranks on the other nodes (`profagent diagnose` there) or at the network "
                    "(NCCL_DEBUG=INFO, TORCH_DISTRIBUTED_DEBUG=DETAIL)"),
    "collective_mismatch": ("make every rank call the same collectives in the same order: a collective under "
                            "an `if` that depends on the rank or on the data is skipped by some ranks; "
                            "TORCH_DISTRIBUTED_DEBUG=DETAIL checks the order"),
    "uneven_inputs": ("make every rank see the same number of batches (DistributedSampler, drop_last) "
                      "or use DDP's join() (torch.distributed.algorithms.Join)"),
}


def _end_of_loop(w: CollectiveWait | None) -> bool:
    return w is not None and not w.native and w.collective in END_OF_LOOP


def _from_backward(w: CollectiveWait | None) -> bool:
    return w is not None and "from backward" in w.collective


def _worker_text(s: RankStall) -> str:
    stuck = s.stuck_workers
    return "; ".join(f"its DataLoader worker PID {w.pid} stands still at {_frames_here(w.frames)} "
                     f"for {w.unchanged_seconds:.0f} s" for w in stuck)


def held_up_ranks(stalls: Iterable[RankStall]) -> set[tuple[str, str]]:
    """(job_id, rank) of the ranks stalled, or waiting on a DataLoader worker that stands still
    (or whose workers are being looked at): no rank-level advice (``dataloader_bound``'s "more
    workers") while they are."""
    return {(s.job_id, s.rank) for s in stalls
            if s.stalled or s.stuck_workers or s.workers_pending}


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


# Input: each rank's ``RankStall`` from the stacks source (stalled or not, the main thread's
# current stack, and the same stack with native frames when a native window caught it).
# In a collective every rank must arrive: a rank whose stack is in the collective layer
# (Python ``torch.distributed``, or native frames: DDP's reducer, ``Work::wait``, gloo,
# NCCL; see analysis/collectives.py) is a victim; a rank that is not is the culprit.
# When every rank this agent sees waits in the same collective, the rank holding them up
# is elsewhere (another node) or the network is stuck; in different collectives, the
# ranks took different paths (a collective mismatch); when some wait in an end-of-loop
# collective (``barrier``, ``destroy_process_group``, an all_reduce outside backward) while the
# others still wait in backward's all_reduce, the ranks had different numbers of batches
# (uneven inputs). A rank whose main thread waits for its DataLoader while one of its worker
# processes stands still making a batch is held up by that worker: the worker is named.
#
# Each place is the rank's own line (the innermost frame of the job's code), with the
# innermost Python frame beside it in the evidence (``innermost``): a wait's innermost
# frames change (a poll loop waking every few seconds), its own line does not.
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
    # a stalled rank waiting for its DataLoader: its workers' stacks say who holds it up
    if not settled and any(s.stalled and s.workers_pending for s in rows):
        return []
    waiting = [s for s in rows if waits[s.rank] is not None]
    culprits = [s for s in rows if waits[s.rank] is None]
    seconds = max(s.unchanged_seconds for s in stalled)
    roles = {s.rank: {
        "role": "waiting" if waits[s.rank] else "culprit", "stalled": s.stalled,
        "at": _where(_here(s)), "innermost": _where(innermost_python(s.frames)),
        "collective": _in(waits[s.rank]) if waits[s.rank] else None,
        "native_frames": bool(s.native),
        # where it is (a waiting rank: the user's line that called the collective), for the
        # profagent_hang_rank_info series that rules join across nodes
        "location": _location((w.called_at or _here(s)) if (w := waits[s.rank]) else _here(s)),
    } for s in rows}
    workers = {s.rank: [{"pid": w.pid, "stuck": w.stuck, "at": _frames_here(w.frames),
                         "unchanged_seconds": round(w.unchanged_seconds, 1), "stack": _stack_lines(w.frames)}
                        for w in s.workers] for s in rows if s.workers}
    evidence: dict[str, Any] = {
        "stalled_ranks": _order(s.rank for s in stalled),
        "unchanged_seconds": round(seconds, 1),
        "roles": roles,
        "waiting_ranks": _order(s.rank for s in waiting),
        "culprit_ranks": _order(s.rank for s in culprits),
        "stacks": {s.rank: _stack_lines(s.native or s.frames) for s in rows},
    }
    if workers:
        evidence["dataloader_workers"] = workers
    if waiting:
        first = waits[next((s for s in waiting if s.stalled), waiting[0]).rank]
        evidence["collective"] = first.describe() if first else "?"
        evidence["called_at"] = _where(first.called_at if first else None)
        evidence["collectives"] = {s.rank: _in(waits[s.rank]) for s in waiting}

    def finding(rank: str | None, diagnosis: str, summary: str, advice: str = "") -> list[Finding]:
        return [Finding("hang", job_id, rank, "critical", summary, {**evidence, "diagnosis": diagnosis},
                        advice=advice or ADVICE[diagnosis])]

    def at(s: RankStall) -> str:
        """"rank 0 at train (train.py:190)", and the worker that holds it up."""
        text = f"rank {s.rank} at {_where(_here(s))}"
        return f"{text}, waiting for its DataLoader: {_worker_text(s)}" if s.stuck_workers else text

    def advice_for(stuck: Sequence[RankStall], diagnosis: str) -> str:
        return ADVICE["worker"] if any(s.stuck_workers for s in stuck) else ADVICE[diagnosis]

    # a rank standing still in a collective (stalled, or for a whole window) waits for the
    # culprit even before its own stall_seconds are over
    if not any(waits[s.rank] and (s.stalled or s.suspected) for s in rows):  # stuck outside any collective
        stuck = stalled
        for key in ("collective", "called_at", "collectives"):
            evidence.pop(key, None)
        evidence["waiting_ranks"] = []
        evidence["culprit_ranks"] = _order(s.rank for s in stuck)
        evidence["culprit_locations"] = {s.rank: _where(_here(s)) for s in stuck}
        where = "; ".join(at(s) for s in stuck)
        return finding(stuck[0].rank if len(stuck) == 1 else None, "stuck",
                       f"{_ranks((s.rank for s in stuck), ('is', 'are'))} stuck, not in a collective "
                       f"(stack unchanged for {seconds:.0f} s): {where}: a deadlock, a blocking read or an endless loop",
                       advice_for(stuck, "stuck"))
    if culprits:
        evidence["culprit_locations"] = {c.rank: _where(_here(c)) for c in culprits}
        where = "; ".join(at(c) for c in culprits)
        victims = "; ".join(f"{_ranks([s.rank], ('waits', 'wait'))} in {_in(waits[s.rank])}" for s in waiting)
        return finding(culprits[0].rank if len(culprits) == 1 else None, "culprit",
                       f"{_ranks((c.rank for c in culprits), ('holds', 'hold'))} the job up, not in a collective: "
                       f"{where}. The others wait for {seconds:.0f} s: {victims}", advice_for(culprits, "culprit"))
    distinct = {_in(w) for w in waits.values()}
    if len(distinct) == 1:
        return finding(None, "all_waiting",
                       f"every rank seen here ({', '.join(evidence['waiting_ranks'])}) waits in {_in(first)} "
                       f"for {seconds:.0f} s: the rank holding it up is on another node, or the network is stuck")
    ended = [s for s in waiting if _end_of_loop(waits[s.rank])]
    training = [s for s in waiting if _from_backward(waits[s.rank])]
    if ended and training and len(ended) + len(training) == len(waiting):
        evidence["diagnosis_ranks"] = {"finished": _order(s.rank for s in ended),
                                       "training": _order(s.rank for s in training)}
        done = "; ".join(f"rank {s.rank} waits in {waits[s.rank].collective} at {_where(_here(s))}" for s in ended)
        still = "; ".join(f"rank {s.rank} at {_where(_here(s))}" for s in training)
        return finding(None, "uneven_inputs",
                       f"uneven inputs for {seconds:.0f} s: {_ranks((s.rank for s in ended), ('finished its', 'finished their'))} "
                       f"data early and waits at the end of its loop ({done}) while "
                       f"{_ranks((s.rank for s in training), ('still trains', 'still train'))}, waiting in "
                       f"all_reduce from backward ({still}): {ADVICE['uneven_inputs']}")
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

"""A whole job from its ranks' traces: a per-rank table, the straggler from collectives,
and why a set of traces cannot be one job.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from profagent.analysis.straggler import judge
from profagent.contracts import TraceReport

STRAGGLER_THRESHOLD = 0.25
MIN_GAP = 100e-6  # seconds per step
MAX_APART = 24 * 3600.0  # seconds between the first and the last trace's start
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


def rank_in_file_name(name: str) -> str | None:
    """The rank a trace's file name gives (``rank<N>``, ``rank_<N>``, ``rank-<N>``), else None."""
    m = _RANK_IN_NAME.search(name)
    return str(int(m.group(1))) if m else None


def _collective(r: TraceReport) -> float | None:
    """Seconds per step in communication (see the module doc); None without steps."""
    if not r.steps or r.steps_inferred:
        return None
    comm = [d["comm"] for d in r.devices if d.get("comm")]
    if comm:
        return sum(comm) / len(comm) / len(r.steps)
    return r.breakdown.get("communication", 0.0) * (r.step_mean or 0.0)


def _mean(values: list[tuple[float, int]]) -> float | None:
    """Step-weighted mean of (value, steps) pairs."""
    n = sum(w for _, w in values)
    return sum(v * w for v, w in values) / n if n else None


def rank_table(reports: Sequence[tuple[TraceReport, str | None]]) -> dict[str, dict[str, Any]]:
    """Per rank: traces, steps, step_seconds, compute, communication, idle (ratios of step
    time), overlap (of communication), collective_seconds (per step): step-weighted means."""
    groups: dict[str, list[TraceReport]] = {}
    for r, rank in reports:
        groups.setdefault(rank if rank is not None else "unknown", []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for rank in sorted(groups, key=lambda k: (0, int(k)) if k.isdigit() else (1, k)):
        rs = groups[rank]
        timed = [r for r in rs if r.steps and not r.steps_inferred]
        steps = sum(len(r.steps) for r in timed)
        step_total = sum(s.seconds for r in timed for s in r.steps)

        def weighted(fn: Any, rs: list[TraceReport] = timed) -> float | None:
            return _mean([(v, len(r.steps)) for r in rs if (v := fn(r)) is not None])

        out[rank] = {
            "traces": len(rs),
            "steps": steps,
            "step_seconds": step_total / steps if steps else None,
            "compute": weighted(lambda r: None if r.gpu is None else r.gpu.compute_ratio),
            "communication": weighted(lambda r: r.breakdown.get("communication")),
            "idle": weighted(lambda r: None if r.gpu is None else r.gpu.idle_ratio),
            "overlap": weighted(lambda r: None if r.gpu is None else r.gpu.overlap_ratio),
            "collective_seconds": weighted(_collective),
        }
    return out


# The straggler is the rank the others wait for. In a synchronous job every rank's step
# time is the same (each waits at every collective), so step time cannot name it; what
# differs is *where* the time goes: a collective kernel starts when its rank reaches it and
# ends when the last rank has, so the ranks that arrived early spend long in their
# collectives and the late rank spends little. Per rank, ``collective`` is the time per step
# in communication: the union of its NCCL/RCCL kernels (mean over its devices), or, without
# communication kernels (gloo, CPU), the step breakdown's ``communication`` (CPU collective
# ranges). The straggler is the rank whose collective time is the shortest, when the shared
# rule of analysis/straggler.py names it: at least ``threshold`` (default 25%) below the
# median of the other ranks' and at least ``MIN_GAP`` seconds per step below it (a
# difference of microseconds is noise).
def straggler(ranks: dict[str, dict[str, Any]], threshold: float = STRAGGLER_THRESHOLD) -> tuple[str | None, str]:
    """(the rank the others wait for, or None; why, in words)."""
    waits = {k: v["collective_seconds"] for k, v in ranks.items()
             if k != "unknown" and v["collective_seconds"] is not None}
    if len(waits) < 2:
        return None, "fewer than two ranks with steps: no straggler to name"
    if not any(w > 0 for w in waits.values()):
        return None, "no collective in the traces (no NCCL/RCCL kernel, no gloo/c10d range): no straggler to name"
    # the rank that waits least: if the rule does not name it, it names no other rank
    late = judge(waits, min(waits, key=lambda k: (waits[k], k)), MIN_GAP, threshold)
    numbers = (f"rank {late.rank}'s collectives take {late.wait * 1e3:.2f} ms per step against a median "
               f"{late.others_median * 1e3:.2f} ms on the other ranks ({late.shortfall:.0%} shorter)")
    if late.named:
        return late.rank, f"{numbers}: the others wait for it at each collective (it arrives last)"
    return None, f"no straggler: {numbers}, under the {threshold:.0%} threshold"


# A set is not one job when its traces disagree on the world size or the backend in
# ``distributedInfo``, or were taken more than ``MAX_APART`` seconds apart; then
# ``warnings`` says so and no straggler is named.
def job_warnings(reports: Sequence[tuple[TraceReport, str | None]]) -> list[str]:
    """Why these traces cannot be one job (empty when they can)."""
    out = []
    sizes = sorted({r.world_size for r, _ in reports if r.world_size is not None})
    if len(sizes) > 1:
        out.append(f"the traces have different world sizes ({', '.join(map(str, sizes))}) in distributedInfo: "
                   "not one job; analyse each job's folder apart")
    backends = sorted({r.backend for r, _ in reports if r.backend is not None})
    if len(backends) > 1:
        out.append(f"the traces have different backends ({', '.join(backends)}) in distributedInfo: not one job")
    starts = [r.started_at for r, _ in reports if r.started_at is not None]
    if len(starts) > 1 and max(starts) - min(starts) > MAX_APART:
        days = (max(starts) - min(starts)) / 86400
        out.append(f"the traces were taken {days:.1f} days apart: not one run of a job")
    return out


def job_summary(reports: Sequence[tuple[TraceReport, str | None]],
                threshold: float = STRAGGLER_THRESHOLD) -> dict[str, Any]:
    """The cross-rank summary of ``profagent analyze`` (see the module doc)."""
    ranks = rank_table(reports)
    warnings = job_warnings(reports)
    late, why = straggler(ranks, threshold)
    if warnings:
        late, why = None, "no straggler named: " + warnings[0]
    timed = [v["step_seconds"] for k, v in ranks.items() if v["step_seconds"] and k != "unknown"]
    spread = max(timed) / min(timed) - 1 if len(timed) >= 2 else None
    return {"ranks": ranks, "straggler_rank": late, "straggler_why": why, "threshold": threshold,
            "spread": spread, "warnings": warnings}

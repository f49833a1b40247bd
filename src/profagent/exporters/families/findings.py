"""Findings families: ``profagent_finding{job_id,rank,finding,severity}`` = 1 while active,
each hung rank's part in the hang (``profagent_hang_rank_info``), and each rank's
collective-wait share (``profagent_collective_wait_ratio``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from profagent.contracts import Finding, FindingsSnapshot
from profagent.exporters.families import Families
from profagent.labels import bound, printable

HANG_ROLES = ("culprit", "waiting")
HANG_DIAGNOSES = ("culprit", "stuck", "all_waiting", "collective_mismatch")


def render(snap: FindingsSnapshot, out: Families) -> None:
    active = out.gauge(
        "profagent_finding",
        "1 while the finding is active (rank \"\" = the whole job); see docs/diagnosis.md and GET /api/findings",
        ("job_id", "rank", "finding", "severity"),
    )
    since = out.gauge(
        "profagent_finding_since_timestamp_seconds", "Unix time at which the active finding began",
        ("job_id", "rank", "finding"),
    )
    for f in snap.findings:
        active.add_metric([f.job_id, f.rank or "", f.finding, f.severity], 1)
        since.add_metric([f.job_id, f.rank or "", f.finding], f.since)
    roles = out.gauge(
        "profagent_hang_rank_info",
        "1 for each rank of a job with an active hang finding seen by this agent: its part (hang_role: "
        "culprit, or waiting in a collective), the hang's diagnosis, and its location (file:line; a waiting "
        "rank's line that called the collective). Rules join it across nodes into one verdict per job",
        ("job_id", "rank", "diagnosis", "hang_role", "location"),
    )
    for f in snap.findings:
        for rank, diagnosis, role, location in hang_roles(f):
            roles.add_metric([f.job_id, rank, diagnosis, role, location], 1)
    waits = out.gauge(
        "profagent_collective_wait_ratio",
        "Share of the rank's main-thread time spent waiting in collectives over findings.window_seconds "
        "(Python torch.distributed frames and native ones: DDP's reducer, Work::wait, gloo, NCCL); absent "
        "during warm-up. The rank far below its job's median is the one the others wait for",
        ("job_id", "rank"),
    )
    for job, rank, share in snap.wait_shares:
        waits.add_metric([job, rank], share)


def hang_roles(f: Finding) -> list[tuple[str, str, str, str]]:
    """(rank, diagnosis, hang_role, location) of each rank of a hang finding; [] for others.
    Every value is bounded and printable: the evidence names files of the watched job."""
    if f.finding != "hang":
        return []
    diagnosis = f.evidence.get("diagnosis")
    roles = f.evidence.get("roles")
    if diagnosis not in HANG_DIAGNOSES or not isinstance(roles, Mapping):
        return []
    rows = []
    for rank, part in roles.items():
        if not isinstance(part, Mapping) or part.get("role") not in HANG_ROLES:
            continue
        location: Any = part.get("location")
        rows.append((bound(str(rank)), diagnosis, part["role"], bound(printable(location) if isinstance(location, str) else "?")))
    return sorted(rows)

"""Findings families: ``profagent_finding{job_id,rank,finding,severity}`` = 1 while active,
and each rank's collective-wait share (``profagent_collective_wait_ratio``)."""

from __future__ import annotations

from profagent.contracts import FindingsSnapshot
from profagent.exporters.families import Families


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
    waits = out.gauge(
        "profagent_collective_wait_ratio",
        "Share of the rank's main-thread time spent waiting in collectives over findings.window_seconds "
        "(Python torch.distributed frames and native ones: DDP's reducer, Work::wait, gloo, NCCL); absent "
        "during warm-up. The rank far below its job's median is the one the others wait for",
        ("job_id", "rank"),
    )
    for job, rank, share in snap.wait_shares:
        waits.add_metric([job, rank], share)

"""Findings families: ``profagent_finding{job_id,rank,finding,severity}`` = 1 while active."""

from __future__ import annotations

from profagent.analysis.findings import FindingsSnapshot
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

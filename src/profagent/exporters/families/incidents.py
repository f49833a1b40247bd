"""Incident families: bundles captured per job and trigger kind (for dashboard annotations)."""

from __future__ import annotations

from profagent.contracts import IncidentsSnapshot
from profagent.exporters.families import Families


def render(snap: IncidentsSnapshot, out: Families) -> None:
    """counts, suppressed: (job_id, kind, n); rejected: (reason, n)."""
    total = out.counter("profagent_incidents", "incident bundles captured, by job and trigger kind (hang, regression, manual)", ("job_id", "kind"))
    for job_id, kind, n in snap.counts:
        total.add_metric([job_id, kind], n)
    limited = out.counter("profagent_incidents_rate_limited", "incident triggers not captured because of incidents.rate_limit_seconds", ("job_id", "kind"))
    for job_id, kind, n in snap.suppressed:
        limited.add_metric([job_id, kind], n)
    rejected = out.counter("profagent_incidents_traces_rejected", "on-demand trace files a capture refused to copy, by reason (symlink, not_regular, foreign_owner, too_large, corrupt, not_a_trace, unreadable)", ("reason",))
    for reason, n in getattr(snap, "rejected", ()):
        rejected.add_metric([reason], n)

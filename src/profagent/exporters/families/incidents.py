"""Incident families: bundles captured per job and trigger kind (for dashboard annotations)."""

from __future__ import annotations

from typing import Any

from profagent.exporters.families import Families


def render(snap: Any, out: Families) -> None:
    """``snap`` is an engine IncidentsSnapshot (counts, suppressed: (job_id, kind, n))."""
    total = out.counter("profagent_incidents", "incident bundles captured, by job and trigger kind (hang, regression, manual)", ("job_id", "kind"))
    for job_id, kind, n in snap.counts:
        total.add_metric([job_id, kind], n)
    limited = out.counter("profagent_incidents_rate_limited", "incident triggers not captured because of incidents.rate_limit_seconds", ("job_id", "kind"))
    for job_id, kind, n in snap.suppressed:
        limited.add_metric([job_id, kind], n)

"""On-demand source families: which ranks can be traced now, and the endpoint's traffic."""

from __future__ import annotations

from profagent.contracts import OndemandSnapshot
from profagent.exporters.families import Families


def render(snap: OndemandSnapshot, out: Families) -> None:
    procs = out.gauge(
        "profagent_ondemand_processes",
        "processes polling the Kineto endpoint (traceable with `profagent trace`), by rank and role",
        ("job_id", "rank", "role"),
    )
    for job_id, rank, role, count in snap.processes:
        procs.add_metric([job_id, rank, role], count)
    out.gauge(
        "profagent_ondemand_unmatched_processes",
        "processes polling the Kineto endpoint that are not part of the target",
        (),
    ).add_metric([], snap.unmatched)
    datagrams = out.counter("profagent_ondemand_datagrams", "datagrams received on the Kineto endpoint by kind", ("kind",))
    for kind, n in snap.datagrams:
        datagrams.add_metric([kind], n)
    requests = out.counter(
        "profagent_ondemand_trace_requests",
        "on-demand trace requests: requested (by profagent trace or the periodic mode), sent (config delivered to a process), resent (sent again: libkineto dropped it), expired (never picked up)",
        ("status",),
    )
    for status, n in snap.requests:
        requests.add_metric([status], n)

"""The agent's own families: build, target, collector health and the CPU each collector costs."""

from __future__ import annotations

from collections.abc import Mapping

from profagent import __version__
from profagent.contracts import PLACEMENT_LABELS, StateView
from profagent.exporters.families import Families

JOB = ("job_id",)


def render_build(out: Families) -> None:
    out.gauge("profagent_build_info", "profagent build; value is 1", ("version",)).add_metric(
        [__version__], 1
    )


def render_target(view: StateView, out: Families) -> None:
    tree = view.tree
    if tree is None:
        return
    up = out.gauge("profagent_target_up", "1 while any process of the job is alive", JOB)
    for job_id, alive in sorted(tree.job_status().items()):
        up.add_metric([job_id], 1 if alive else 0)
    info = out.gauge(
        "profagent_target_info",
        "one series per process of the target tree; value is 1 (PIDs appear only here)",
        ("job_id", "rank", "local_rank", "world_size", "role", "pid", "cmdline", *PLACEMENT_LABELS),
    )
    for p in tree.processes:
        info.add_metric(
            [p.job_id, p.rank, p.local_rank, p.world_size, p.role, str(p.pid), p.cmdline, *p.placement.labels()], 1
        )


def render_health(view: StateView, out: Families) -> None:
    up = out.gauge("profagent_collector_up", "1 if the collector runs, 0 if it is off", ("collector",))
    errors = out.counter(
        "profagent_collector_errors", "failed collector ticks by reason", ("collector", "reason")
    )
    duration = out.gauge(
        "profagent_collector_duration_seconds", "duration of the collector's last tick", ("collector",)
    )
    last = out.gauge(
        "profagent_collector_last_success_timestamp_seconds",
        "Unix time of the collector's last successful tick",
        ("collector",),
    )
    not_applicable = out.gauge(
        "profagent_collector_not_applicable",
        "1 for a collector that is off because it has nothing to do here (reason: no_gpu, held_by_another_agent)",
        ("collector", "reason"),
    )
    retrying = out.gauge(
        "profagent_collector_retrying",
        "1 for a collector that is off for now and retries by itself (reason: endpoint_held, the Kineto "
        "endpoint bound by another user's process)",
        ("collector", "reason"),
    )
    for name, health in sorted(view.health.items()):
        up.add_metric([name], 1 if health.up else 0)
        if not health.up and health.retrying:
            retrying.add_metric([name, health.retrying], 1)
        if not health.up and health.not_applicable:
            not_applicable.add_metric([name, health.not_applicable], 1)
        for reason, count in sorted(health.errors.items()):
            errors.add_metric([name, reason], count)
        if health.last_duration is not None:
            duration.add_metric([name], health.last_duration)
        if health.last_success is not None:
            last.add_metric([name], health.last_success)


def render_series_dropped(dropped: Mapping[str, int], out: Families) -> None:
    """Series of each job left out of /metrics by agent.max_series_per_job (absent when none)."""
    if not dropped:
        return
    fam = out.gauge("profagent_series_dropped",
                    "series of the job left out of this exposition by agent.max_series_per_job, its highest ranks first",
                    ("job_id",))
    for job, n in sorted(dropped.items()):
        fam.add_metric([job], n)


def render_cpu(seconds: Mapping[str, float], children: Mapping[str, float], out: Families) -> None:
    """CPU the agent spends per collector (thread CPU clock; py-spy children in ``stacks``)."""
    cpu = out.counter(
        "profagent_collector_cpu_seconds",
        "CPU time spent by each part of the agent (its threads' CPU clock; for stacks, py-spy's too)",
        ("collector",),
    )
    for name, value in sorted(seconds.items()):
        cpu.add_metric([name], value)
    if "stacks" in children:
        out.counter(
            "profagent_pyspy_cpu_seconds", "CPU time of the py-spy children the stacks collector ran", ()
        ).add_metric([], children["stacks"])

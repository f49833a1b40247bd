"""Agent health: are the collectors up, what fails, how long collection and scrapes take."""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard

from profagent_dashboards.common import (
    BY_KEY,
    BYTES,
    CORES,
    INST,
    NONE,
    PER_SECOND,
    SECONDS,
    dashboard,
    q,
    row,
    stat_panel,
    table_panel,
    ts,
    up_mappings,
)

BOARD = BY_KEY["agent"]


def build() -> Dashboard:
    d = dashboard(BOARD, "Is profagent itself healthy: collectors, errors, collection and scrape cost, CPU per collector.")
    d = (
        d.with_row(row("Collectors"))
        .with_panel(stat_panel(
            "Collectors up", NONE,
            [q(f"profagent_collector_up{{{INST}}}", "{{instance}} {{collector}}", instant=True)],
            "1 if the collector runs; 0 if it is off (the agent's log and `profagent doctor` say why)",
            width=12, height=6, mappings=up_mappings("ON", "OFF"), thresholds=((None, "red"), (1, "green")),
        ))
        .with_panel(table_panel(
            "Collector errors over the time range", NONE,
            [q(f"sum by (instance, collector, reason) (increase(profagent_collector_errors_total{{{INST}}}[$__range]))",
               instant=True, table_format=True)],
            "failed collector ticks by reason (unavailable, target_gone, ...)",
            width=12, height=6, rename={"Value": "errors"}, sort_by="errors",
        ))
        .with_panel(ts(
            "Collector errors by reason", PER_SECOND,
            [q(f"sum by (instance, collector, reason) (rate(profagent_collector_errors_total{{{INST}}}[$__rate_interval]))",
               "{{instance}} {{collector}} {{reason}}")],
            "failed collector ticks per second", width=8,
        ))
        .with_panel(ts(
            "Collection duration", SECONDS,
            [q(f"profagent_collector_duration_seconds{{{INST}}}", "{{instance}} {{collector}}")],
            "duration of each collector's last tick", width=8,
        ))
        .with_panel(ts(
            "Time since the last successful tick", SECONDS,
            [q(f"time() - profagent_collector_last_success_timestamp_seconds{{{INST}}}", "{{instance}} {{collector}}")],
            "grows while a collector keeps failing", width=8,
        ))
        .with_row(row("Scrape"))
        .with_panel(stat_panel(
            "Scrape target up", NONE, [q(f"up{{{INST}}}", "{{instance}}", instant=True)],
            "Prometheus' own `up` for the agent's endpoint", width=6, height=6,
            mappings=up_mappings(), thresholds=((None, "red"), (1, "green")),
        ))
        .with_panel(ts(
            "Scrape duration", SECONDS, [q(f"scrape_duration_seconds{{{INST}}}", "{{instance}}")],
            "how long Prometheus takes to scrape the agent", width=9, height=6,
        ))
        .with_panel(ts(
            "Samples per scrape", NONE, [q(f"scrape_samples_scraped{{{INST}}}", "{{instance}}")],
            "series in the agent's exposition; a steady climb means a label is unbounded", width=9, height=6,
        ))
        .with_panel(ts(
            "Series dropped by the per-job cap", NONE,
            [q(f"profagent_series_dropped{{{INST}}}", "{{instance}} {{job_id}}")],
            "series a job would have had beyond agent.max_series_per_job (ranks churning, a job too wide): "
            "its highest ranks are left out of /metrics", width=24, height=6,
        ))
        .with_row(row("The agent process"))
        .with_panel(ts(
            "Agent CPU", CORES,
            [q(f"rate(process_cpu_seconds_total{{{INST}}}[$__rate_interval])", "{{instance}}")],
            "CPU used by the profagent process itself (py-spy runs are separate processes)", width=6,
        ))
        .with_panel(ts(
            "Agent CPU by collector", CORES,
            [q(f"sum by (instance, collector) (rate(profagent_collector_cpu_seconds_total{{{INST}}}[$__rate_interval]))",
               "{{instance}} {{collector}}")],
            "where the agent's CPU goes: each collector's threads (thread CPU clock) and, for stacks, "
            "its py-spy children", width=6,
        ))
        .with_panel(ts(
            "py-spy CPU", CORES,
            [q(f"rate(profagent_pyspy_cpu_seconds_total{{{INST}}}[$__rate_interval])", "{{instance}}")],
            "CPU of the py-spy children (also inside stacks in the panel beside)", width=6,
        ))
        .with_panel(ts(
            "Agent memory", BYTES,
            [q(f"process_resident_memory_bytes{{{INST}}}", "{{instance}}")],
            "resident memory of the profagent process", width=6,
        ))
        .with_panel(ts(
            "Agent open file descriptors", NONE,
            [q(f"process_open_fds{{{INST}}}", "{{instance}}")],
            "open file descriptors of the profagent process", width=6,
        ))
        .with_panel(table_panel(
            "Agent versions", NONE,
            [q(f"count by (instance, version) (profagent_build_info{{{INST}}})", instant=True, table_format=True)],
            "profagent version per node", width=6, rename={"Value": "agents"},
        ))
    )
    return d

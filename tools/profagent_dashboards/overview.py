"""Job overview: is my job healthy, and where does its time go? One screen."""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import AnnotationQuery, Dashboard

from profagent_dashboards.common import (
    BY_KEY,
    BYTES,
    CORES,
    DS,
    GPU,
    INST,
    JOB,
    NONE,
    PERCENT,
    RANK,
    SECONDS,
    dashboard,
    q,
    row,
    stat_panel,
    table_panel,
    ts,
    up_mappings,
)
from profagent_dashboards.stacks import category_share

BOARD = BY_KEY["overview"]

# GPU utilisation of the devices a rank uses: the device's figure, joined on the rank's
# per-process GPU memory series (which say which rank runs on which device).
RANK_GPU_UTIL = (
    "max by (job_id, rank, gpu) ("
    f"max by (instance, gpu) (profagent_gpu_utilization_ratio{{{GPU}}})"
    " * on (instance, gpu) group_right () "
    f"(0 * profagent_process_gpu_memory_used_bytes{{{RANK}, gpu=~\"$gpu\"}} + 1))"
)


# Active findings with how long each has been active (the severity comes from profagent_finding).
FINDINGS_NOW = (
    f"(time() - max by (instance, job_id, rank, finding) (profagent_finding_since_timestamp_seconds{{{JOB}}}))"
    " * on (instance, job_id, rank, finding) group_left (severity) "
    f"max by (instance, job_id, rank, finding, severity) (profagent_finding{{{JOB}}})"
)


def build() -> Dashboard:
    d = dashboard(BOARD, "Is the job healthy, and where does its time go? Start here.")
    # A mark at each incident bundle (profagent incidents show ID tells what was captured).
    d = d.annotation(
        AnnotationQuery().name("Incidents").datasource(DS).enable(True).icon_color("red")
        .expr(f"changes(profagent_incidents_total{{{JOB}}}[$__rate_interval]) > 0")
    )
    d = (
        d.with_row(row("What's wrong now"))
        .with_panel(table_panel(
            "What's wrong now", SECONDS,
            [q(FINDINGS_NOW, instant=True, table_format=True)],
            "active findings (hang and its culprit rank, straggler, *_bound, memory_leak, GPU problems; rank empty = "
            "the whole job) and how long each has been active. `profagent diagnose --url <agent>` prints each one's "
            "summary and evidence; docs/diagnosis.md says what to do. Empty = nothing wrong that profagent can see.",
            width=24, height=6, rename={"Value": "active for"}, sort_by="active for",
        ))
        .with_row(row("Job"))
        .with_panel(stat_panel(
            "Target up", NONE, [q(f"max by (job_id) (profagent_target_up{{{JOB}}})", "{{job_id}}", instant=True)],
            "1 while any process of the job is alive (profagent_target_up)",
            mappings=up_mappings(), thresholds=((None, "red"), (1, "green")),
        ))
        .with_panel(stat_panel(
            "Ranks", NONE, [q(f'count by (job_id) (profagent_target_info{{{JOB}, role="main"}})', "{{job_id}}", instant=True)],
            "rank processes alive now",
        ))
        .with_panel(stat_panel(
            "Stalled ranks", NONE, [q(f"sum by (job_id) (profagent_rank_stalled{{{RANK}}})", "{{job_id}}", instant=True)],
            "ranks whose main-thread stack has not changed for stacks.stall_seconds while their GPUs are idle",
            thresholds=((None, "green"), (1, "red")),
        ))
        .with_panel(stat_panel(
            "Traces ingested", NONE,
            [q(f'sum(increase(profagent_traces_total{{{INST}, status="ingested"}}[$__range]))', "ingested", instant=True)],
            "profiler traces ingested from the watched folder over the dashboard's time range",
        ))
        .with_panel(table_panel(
            "Ranks and roles", NONE,
            [q(f"count by (job_id, rank, local_rank, world_size, role) (profagent_target_info{{{JOB}}})",
               instant=True, table_format=True)],
            "processes of the job by rank and role (launcher, main, dataloader workers)",
            width=24, height=6, rename={"Value": "processes"},
        ))
        .with_row(row("Where time goes"))
        .with_panel(ts(
            "Step time per rank (from traces)", SECONDS,
            [q(f"profagent_trace_step_seconds{{{RANK}}}", "rank {{rank}}")],
            "mean step time of each rank's last profiler trace; a rank above the others is a straggler",
        ))
        .with_panel(ts(
            "Step time per rank (kernel probes)", SECONDS,
            [q(f"histogram_quantile(0.5, sum by (job_id, rank, le) (rate(profagent_step_seconds_bucket{{{RANK}}}[$__rate_interval])))",
               "rank {{rank}} p50"),
             q(f"rate(profagent_step_seconds_sum{{{RANK}}}[$__rate_interval]) / rate(profagent_step_seconds_count{{{RANK}}}[$__rate_interval])",
               "rank {{rank}} mean")],
            "time from one optimizer step to the next (median and mean), from uprobes on libtorch: every job, no trace needed",
        ))
        .with_panel(ts(
            "Optimizer steps per second", NONE,
            [q(f"rate(profagent_optimizer_steps_total{{{RANK}}}[$__rate_interval])", "rank {{rank}}"),
             q(f"rate(profagent_backward_passes_total{{{RANK}}}[$__rate_interval])", "rank {{rank}} backwards")],
            "throughput in optimizer steps; backward passes above it mean gradient accumulation",
        ))
        .with_panel(ts(
            "Where each step goes (kernel probes)", PERCENT,
            [q(f"sum by (rank, stage) (rate(profagent_step_stage_seconds_total{{{RANK}}}[$__rate_interval]))"
               f" / ignoring(stage) group_left sum by (rank) (rate(profagent_step_seconds_sum{{{RANK}}}[$__rate_interval]))",
               "rank {{rank}} {{stage}}")],
            "share of step time in DataLoader waits, backward, optimizer, and the rest (forward, host work)", max_value=1,
        ))
        .with_panel(ts(
            "Collective arrival lag (kernel probes, mean)", SECONDS,
            [q(f"rate(profagent_collective_arrival_lag_seconds_sum{{{RANK}}}[$__rate_interval])"
               f" / rate(profagent_collective_arrival_lag_seconds_count{{{RANK}}}[$__rate_interval])", "rank {{rank}}")],
            "how long after the first rank each rank calls its collectives: the straggler arrives last",
        ))
        .with_panel(ts(
            "Where time goes per rank (Python stacks)", PERCENT,
            [q(category_share('role="main"'), "rank {{rank}} {{category}}")],
            "share of main-thread stack samples by category, per rank (see the Python stacks dashboard)",
            max_value=1,
        ))
        .with_panel(ts(
            "Stalled ranks", NONE, [q(f"profagent_rank_stalled{{{RANK}}}", "rank {{rank}}")],
            "1 while a rank's main-thread stack is unchanged and its GPUs are idle (hung collective, deadlock)",
            max_value=1,
        ))
        .with_panel(ts(
            "Traces ingested", NONE,
            [q(f'sum by (instance) (increase(profagent_traces_total{{{INST}, status="ingested"}}[$__rate_interval]))',
               "{{instance}}")],
            "profiler traces ingested per interval",
        ))
        .with_row(row("GPUs"))
        .with_panel(ts(
            "GPU utilisation per rank", PERCENT, [q(RANK_GPU_UTIL, "rank {{rank}} gpu {{gpu}}")],
            "utilisation of the devices each rank has memory on", max_value=1,
        ))
        .with_panel(ts(
            "GPU memory per rank", BYTES,
            [q(f'sum by (job_id, rank, gpu) (profagent_process_gpu_memory_used_bytes{{{RANK}, gpu=~"$gpu"}})',
               "rank {{rank}} gpu {{gpu}}")],
            "GPU memory used by each rank's processes, per device",
        ))
        .with_row(row("Host"))
        .with_panel(ts(
            "CPU per rank and role", CORES,
            [q(f"sum by (job_id, rank, role) (rate(profagent_process_cpu_seconds_total{{{RANK}}}[$__rate_interval]))",
               "rank {{rank}} {{role}}")],
            "CPU cores busy, user + system, per rank (main process and its DataLoader workers)",
        ))
        .with_panel(ts(
            "Waiting for a CPU per rank", PERCENT,
            [q(f'rate(profagent_process_run_queue_seconds_total{{{RANK}, role="main"}}[$__rate_interval])',
               "rank {{rank}}")],
            "share of the time each rank's main thread was runnable but waited for a CPU (schedstat): CPU "
            "contention on the node. Above 10% a straggler named from stacks says the node may be the cause",
            max_value=1,
        ))
        .with_panel(ts(
            "Resident memory per rank and role", BYTES,
            [q(f"profagent_process_resident_memory_bytes{{{RANK}}}", "rank {{rank}} {{role}}"),
             q(f"profagent_process_unique_memory_bytes{{{RANK}}}", "rank {{rank}} {{role}} USS")],
            "resident set size of each rank's processes; for DataLoader workers also USS (pages unique to them: RSS "
            "counts pages shared with the rank several times). Steady growth is a leak",
        ))
    )
    return d

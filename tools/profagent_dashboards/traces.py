"""Torch traces: step time and stragglers, step breakdown, GPU idle and overlap, top tables.

Every figure is from the rank's last ingested torch profiler trace, so these panels move
in steps, each time a new trace lands in the watched folder.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard

from profagent_dashboards.common import (
    BY_KEY,
    BYTES,
    INST,
    NONE,
    PER_SECOND,
    PERCENT,
    RANK,
    SECONDS,
    dashboard,
    q,
    row,
    table_panel,
    ts,
)

BOARD = BY_KEY["traces"]

STEP = f"profagent_trace_step_seconds{{{RANK}}}"


def _top(metric: str, name: str) -> str:
    return f"sort_desc({metric}{{{RANK}, {name}!=\"other\"}})"


def build() -> Dashboard:
    d = dashboard(BOARD, "What the torch profiler traces of each rank say: steps, GPU idle, top kernels and ops.")
    d = (
        d.with_row(row("Steps and stragglers"))
        .with_panel(ts(
            "Step time per rank", SECONDS,
            [q(STEP, "rank {{rank}} mean"), q(f"profagent_trace_step_max_seconds{{{RANK}}}", "rank {{rank}} slowest")],
            "mean and slowest step of each rank's last trace",
        ))
        .with_panel(ts(
            "Stragglers: step time spread across ranks", SECONDS,
            [q(f"max by (job_id) ({STEP}) - min by (job_id) ({STEP})", "{{job_id}} max - min"),
             q(f"max by (job_id) ({STEP})", "{{job_id}} slowest rank"),
             q(f"min by (job_id) ({STEP})", "{{job_id}} fastest rank")],
            "the spread between the slowest and the fastest rank; every rank waits for the slowest one",
        ))
        .with_panel(ts(
            "Rank $rank: step breakdown", PERCENT,
            [q(f"profagent_trace_step_breakdown_ratio{{{RANK}}}", "{{category}}")],
            "share of step time by category (kernel > memcpy > memset > communication > runtime > "
            "dataloader > cpu_exec > other)",
            stacked=True, max_value=1, repeat="rank",
        ))
        .with_row(row("GPU idle and overlap"))
        .with_panel(ts(
            "GPU idle", PERCENT, [q(f"profagent_trace_gpu_idle_ratio{{{RANK}}}", "rank {{rank}}")],
            "share of step time the GPU runs nothing (mean over the rank's devices)", width=8, max_value=1,
        ))
        .with_panel(ts(
            "GPU idle by cause", PERCENT,
            [q(f"profagent_trace_gpu_idle_breakdown_ratio{{{RANK}}}", "rank {{rank}} {{cause}}")],
            "GPU idle time as a share of step time: host_wait (CPU too slow to feed it), kernel_wait, other",
            width=8, max_value=1,
        ))
        .with_panel(ts(
            "GPU utilisation (trace)", PERCENT,
            [q(f"profagent_trace_gpu_utilization_ratio{{{RANK}}}", "rank {{rank}}")],
            "share of step time with at least one kernel running", width=8, max_value=1,
        ))
        .with_panel(ts(
            "Communication overlapped by compute", PERCENT,
            [q(f"profagent_trace_comm_overlap_ratio{{{RANK}}}", "rank {{rank}}")],
            "share of communication kernel time hidden behind compute kernels (higher is better)",
            width=8, max_value=1,
        ))
        .with_panel(ts(
            "memcpy share of GPU time", PERCENT,
            [q(f"profagent_trace_memcpy_gpu_share_ratio{{{RANK}}}", "rank {{rank}}")],
            "memory copies as a share of the time the GPU is busy", width=8, max_value=1,
        ))
        .with_panel(ts(
            "CPU time over GPU time", PERCENT,
            [q(f"profagent_trace_cpu_gpu_time_ratio{{{RANK}}}", "rank {{rank}}")],
            "CPU op and runtime time divided by GPU busy time; above 100% the GPU is starved by the host",
            width=8,
        ))
        .with_panel(ts(
            "Kernel launch delay", SECONDS,
            [q(f"profagent_trace_kernel_launch_delay_seconds{{{RANK}}}", "rank {{rank}} {{stat}}")],
            "kernel start minus the start of its runtime launch call", width=8,
        ))
        .with_panel(ts(
            "Peak allocated memory", BYTES,
            [q(f"profagent_trace_memory_peak_allocated_bytes{{{RANK}}}", "rank {{rank}} {{device}}")],
            "peak allocated memory seen in the trace's [memory] events, per device", width=8,
        ))
        .with_panel(ts(
            "Rank $rank: GPU time", PERCENT,
            [q(f"profagent_trace_gpu_time_ratio{{{RANK}}}", "{{kind}}")],
            "temporal breakdown of step time: compute kernels, non-compute (memcpy, memset...), idle",
            width=8, stacked=True, max_value=1, repeat="rank",
        ))
        .with_row(row("Top kernels, ops and ranges"))
        .with_panel(table_panel(
            "Top kernels (GPU time in the last trace)", SECONDS,
            [q(_top("profagent_trace_top_kernel_seconds", "kernel"), instant=True, table_format=True)],
            "the top-K kernels of each rank's last trace by GPU time (the rest is in kernel=\"other\")",
            rename={"Value": "GPU time"}, sort_by="GPU time", hide=("Time", "__name__", "instance", "job"),
        ))
        .with_panel(table_panel(
            "Top ops (self CPU time in the last trace)", SECONDS,
            [q(_top("profagent_trace_top_op_self_seconds", "op"), instant=True, table_format=True)],
            "the top-K torch ops of each rank's last trace by self CPU time (the rest is in op=\"other\")",
            rename={"Value": "self CPU time"}, sort_by="self CPU time", hide=("Time", "__name__", "instance", "job"),
        ))
        .with_panel(table_panel(
            "record_function ranges (time in the last trace)", SECONDS,
            [q(f"sort_desc(profagent_trace_annotation_seconds{{{RANK}}})", instant=True, table_format=True)],
            "total time per record_function name (top-K, the rest in \"other\")",
            rename={"Value": "time"}, sort_by="time", hide=("Time", "__name__", "instance", "job"),
        ))
        .with_panel(table_panel(
            "Last trace per rank", NONE,
            [q(f"profagent_trace_steps{{{RANK}}}", instant=True, table_format=True),
             q(f"profagent_trace_steps_inferred{{{RANK}}}", instant=True, table_format=True),
             q(f"profagent_trace_last_size_bytes{{{RANK}}}", instant=True, table_format=True),
             q(f"time() - profagent_trace_last_ingested_timestamp_seconds{{{RANK}}}", instant=True, table_format=True)],
            "steps in the rank's last trace (inferred = 1: no ProfilerStep, the whole window is one step), "
            "its uncompressed size and its age",
            merge=True, hide=("Time", "__name__", "instance", "job"),
            rename={"Value #A": "steps", "Value #B": "steps inferred", "Value #C": "size", "Value #D": "age"},
            overrides={"size": BYTES, "age": SECONDS},
        ))
        .with_row(row("Ingestion"))
        .with_panel(ts(
            "Trace files by outcome", NONE,
            [q(f"sum by (instance, status) (increase(profagent_traces_total{{{INST}}}[$__rate_interval]))",
               "{{instance}} {{status}}")],
            "trace files handled by the watcher per interval: ingested, invalid, skipped", width=6,
        ))
        .with_panel(ts(
            "Rejected trace files by reason", NONE,
            [q(f"sum by (instance, status, reason) (profagent_traces_rejected_total{{{INST}}})",
               "{{instance}} {{status}} {{reason}}")],
            "trace files counted invalid or skipped since the agent started, by reason", width=6,
        ))
        .with_panel(ts(
            "Age of each rank's last trace", SECONDS,
            [q(f"time() - profagent_trace_last_ingested_timestamp_seconds{{{RANK}}}", "rank {{rank}}")],
            "seconds since each rank's last trace was ingested; it grows when traces stop arriving", width=6,
        ))
        .with_panel(ts(
            "Trace files waiting", NONE,
            [q(f"profagent_traces_waiting{{{INST}}}", "{{instance}}")],
            "files seen in the watched folder but not complete yet", width=6,
        ))
        .with_row(row("On-demand tracing"))
        .with_panel(ts(
            "Processes traceable on demand", NONE,
            [q(f"profagent_ondemand_processes{{{RANK}}}", "rank {{rank}} {{role}}"),
             q(f"profagent_ondemand_unmatched_processes{{{INST}}}", "{{instance}} not in the job")],
            "processes polling the agent's Kineto endpoint (started with KINETO_USE_DAEMON=1), "
            "which `profagent trace` can trace without a code change", width=8,
        ))
        .with_panel(ts(
            "On-demand trace requests", NONE,
            [q(f"sum by (instance, status) (increase(profagent_ondemand_trace_requests_total{{{INST}}}[$__rate_interval]))",
               "{{instance}} {{status}}")],
            "trace requests per interval: requested (profagent trace or the periodic mode), sent to a "
            "process, expired (never picked up)", width=8,
        ))
        .with_panel(ts(
            "Kineto endpoint datagrams", PER_SECOND,
            [q(f"sum by (instance, kind) (rate(profagent_ondemand_datagrams_total{{{INST}}}[$__rate_interval]))",
               "{{instance}} {{kind}}")],
            "datagrams received on the Kineto endpoint per second: poll, ctxt, malformed", width=8,
        ))
    )
    return d

"""Traces source families: the last ingested trace's figures per rank, and file counts.

Free-form names (kernels, ops, record_function ranges) are bounded: top-K per rank with
the rest folded into "other". Figures a trace cannot provide (GPU ones in a CPU-only
trace, launch delay without correlation...) are absent, never 0.
"""

from __future__ import annotations

from profagent.contracts import TracesSnapshot
from profagent.exporters.families import Families
from profagent.labels import fold_top_k

RANK = ("job_id", "rank")
STATUSES = ("ingested", "invalid", "skipped")


def render(snap: TracesSnapshot, out: Families) -> None:
    total = out.counter("profagent_traces", "trace files handled by the watcher, by outcome", ("status",))
    rejected = out.counter("profagent_traces_rejected", "trace files counted invalid or skipped, by reason", ("status", "reason"))
    for status in STATUSES:
        total.add_metric([status], sum(n for s, _, n in snap.counts if s == status))
    for status, reason, n in snap.counts:
        if status != "ingested":
            rejected.add_metric([status, reason], n)
    out.gauge("profagent_traces_waiting", "trace files seen but not complete yet", ()).add_metric([], snap.waiting)
    # Rendered only while a folder the user gave is watched (the on-demand folder alone does
    # not count: nothing is expected there unless someone asks): ProfagentNoTraces keys on it.
    if snap.user_dirs:
        out.gauge(
            "profagent_traces_dir_configured", "1 while a trace folder the user configured is watched for the job",
            ("job_id",),
        ).add_metric([snap.job_id], 1)

    step = out.gauge("profagent_trace_step_seconds", "mean step time of the rank's last trace", RANK)
    step_max = out.gauge("profagent_trace_step_max_seconds", "slowest step of the rank's last trace", RANK)
    steps = out.gauge("profagent_trace_steps", "steps in the rank's last trace", RANK)
    inferred = out.gauge("profagent_trace_steps_inferred", "1 if the last trace had no ProfilerStep (whole window = one step)", RANK)
    breakdown = out.gauge("profagent_trace_step_breakdown_ratio", "share of step time by category (priority kernel > memcpy > memset > communication > runtime > dataloader > cpu_exec > other)", (*RANK, "category"))
    idle = out.gauge("profagent_trace_gpu_idle_ratio", "share of step time the GPU runs nothing (mean over the rank's devices)", RANK)
    util = out.gauge("profagent_trace_gpu_utilization_ratio", "share of step time with at least one kernel running", RANK)
    temporal = out.gauge("profagent_trace_gpu_time_ratio", "GPU temporal breakdown of step time: compute, non_compute, idle", (*RANK, "kind"))
    idle_split = out.gauge("profagent_trace_gpu_idle_breakdown_ratio", "GPU idle time by cause, as a share of step time: host_wait, kernel_wait, other", (*RANK, "cause"))
    overlap = out.gauge("profagent_trace_comm_overlap_ratio", "share of communication kernel time overlapped by compute kernels", RANK)
    memcpy = out.gauge("profagent_trace_memcpy_gpu_share_ratio", "memcpy share of GPU busy time", RANK)
    cpu_gpu = out.gauge("profagent_trace_cpu_gpu_time_ratio", "CPU op/runtime time over GPU busy time in the steps (>1: GPU starved)", RANK)
    delay = out.gauge("profagent_trace_kernel_launch_delay_seconds", "kernel start minus its runtime launch call's start", (*RANK, "stat"))
    kernels = out.gauge("profagent_trace_top_kernel_seconds", "GPU time of the top-K kernels of the rank's last trace", (*RANK, "kernel"))
    ops = out.gauge("profagent_trace_top_op_self_seconds", "self CPU time of the top-K ops of the rank's last trace", (*RANK, "op"))
    ann = out.gauge("profagent_trace_annotation_seconds", "record_function ranges: total time per name in the last trace (top-K + other)", (*RANK, "annotation"))
    mem = out.gauge("profagent_trace_memory_peak_allocated_bytes", "peak allocated memory from [memory] events", (*RANK, "device"))
    last = out.gauge("profagent_trace_last_ingested_timestamp_seconds", "when the rank's last trace was ingested (Unix time)", RANK)
    size = out.gauge("profagent_trace_last_size_bytes", "uncompressed JSON size of the rank's last trace", RANK)
    info = out.gauge("profagent_trace_info", "1 per rank's last trace; accelerator: cuda, rocm, mtia, xpu, privateuse1 or none", (*RANK, "accelerator"))
    incomplete = out.gauge("profagent_trace_steps_incomplete", "ProfilerSteps of the rank's last trace excluded as incomplete (profiler stopped inside)", RANK)

    for rt in snap.ranks:
        r = rt.report
        labels = [rt.job_id or snap.job_id, rt.rank]
        last.add_metric(labels, rt.ingested_at)
        size.add_metric(labels, r.bytes)
        steps.add_metric(labels, len(r.steps))
        info.add_metric([*labels, r.accelerator or "none"], 1)
        incomplete.add_metric(labels, len(r.steps_incomplete))
        inferred.add_metric(labels, 1.0 if r.steps_inferred else 0.0)
        # a trace without ProfilerStep has no step time: its window is not one step
        if r.step_mean is not None and r.step_max is not None and not r.steps_inferred:
            step.add_metric(labels, r.step_mean)
            step_max.add_metric(labels, r.step_max)
        for category, ratio in r.breakdown.items():
            breakdown.add_metric([*labels, category], ratio)
        g = r.gpu
        if g is not None:
            idle.add_metric(labels, g.idle_ratio)
            util.add_metric(labels, g.utilization)
            temporal.add_metric([*labels, "compute"], g.compute_ratio)
            temporal.add_metric([*labels, "non_compute"], g.non_compute_ratio)
            temporal.add_metric([*labels, "idle"], g.idle_ratio)
            idle_split.add_metric([*labels, "host_wait"], g.host_wait_ratio)
            idle_split.add_metric([*labels, "kernel_wait"], g.kernel_wait_ratio)
            idle_split.add_metric([*labels, "other"], g.idle_other_ratio)
            memcpy.add_metric(labels, g.memcpy_share)
            if g.overlap_ratio is not None:
                overlap.add_metric(labels, g.overlap_ratio)
        if r.cpu_gpu_ratio is not None:
            cpu_gpu.add_metric(labels, r.cpu_gpu_ratio)
        if r.launch_delay is not None:
            for stat, value in r.launch_delay.items():
                delay.add_metric([*labels, stat], value)
        for family, rows in ((kernels, r.top_kernels), (ops, r.top_ops), (ann, r.annotations)):
            for name, seconds in fold_top_k(((n, s) for n, s, _ in rows), snap.top_k).items():
                family.add_metric([*labels, name], seconds)
        for device, peak in r.memory_peak.items():
            mem.add_metric([*labels, device], peak)

"""The facade: one parsed trace in, every figure out (parse once, analyze many).

``analyze()`` runs each analyzer on the same classified events and returns an immutable
``TraceReport`` in seconds and ratios. ``readings()`` turns it into plain-language advice
(the ``findings`` of ``analyze --json``; not the live findings of ``analysis/findings``).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from profagent.analysis.trace.annotations import Annotation, annotation_gpu_time, annotations
from profagent.analysis.trace.breakdown import CATEGORIES, step_breakdown
from profagent.analysis.trace.cputime import cpu_gpu_time
from profagent.analysis.trace.devices import DeviceTime, device_times
from profagent.analysis.trace.kinds import US, Frame, accelerator, classify_events
from profagent.analysis.trace.launch import LaunchDelay, launch_delay
from profagent.analysis.trace.memory import peak_allocated
from profagent.analysis.trace.model import Trace
from profagent.analysis.trace.steps import find_steps
from profagent.analysis.trace.tops import Top, kernel_stats, top_kernels, top_ops, totals_in_steps
from profagent.contracts import GpuSummary, StepTime, TraceReport
from profagent.labels import OTHER, fold_top_k


def _gpu_summary(devices: tuple[DeviceTime, ...]) -> GpuSummary | None:
    if not devices:
        return None
    n = len(devices)

    def mean(fn: Any) -> float:
        return sum(fn(d) for d in devices) / n

    def ratio(d: DeviceTime, value: float) -> float:
        return value / d.window if d.window > 0 else 0.0

    overlaps = [d.overlap for d in devices if d.overlap is not None]
    busy = sum(d.busy for d in devices)
    return GpuSummary(
        devices=n,
        utilization=mean(lambda d: d.utilization),
        idle_ratio=mean(lambda d: d.idle_ratio),
        compute_ratio=mean(lambda d: ratio(d, d.compute)),
        non_compute_ratio=mean(lambda d: ratio(d, d.non_compute)),
        host_wait_ratio=mean(lambda d: ratio(d, d.host_wait)),
        kernel_wait_ratio=mean(lambda d: ratio(d, d.kernel_wait)),
        idle_other_ratio=mean(lambda d: ratio(d, d.idle_other)),
        overlap_ratio=sum(overlaps) / len(overlaps) if overlaps else None,
        memcpy_share=sum(d.memcpy for d in devices) / busy if busy > 0 else 0.0,
    )


def _tops(tops: tuple[Top, ...] | tuple[Annotation, ...]) -> tuple[tuple[str, float, int], ...]:
    return tuple((t.name, t.time * US if isinstance(t, Top) else t.total * US, t.count) for t in tops)


def analyze(trace: Trace, top_k: int = 10, iteration_window: bool = False, in_steps: bool = False) -> TraceReport:
    """Every figure of one trace. Pure: reads ``trace``, returns a new report.
    ``iteration_window``: the trace was asked for N iterations (see ``find_steps``);
    ``in_steps``: also every kernel's and op's time inside the steps (for a diff)."""
    c = classify_events(trace)
    steps = find_steps(c, iteration_window)
    frame = Frame(c, steps.spans)
    bd = step_breakdown(frame)
    devices = device_times(c, frame)
    delay: LaunchDelay | None = launch_delay(c)
    cpu_us, gpu_us = cpu_gpu_time(frame)
    durations = [s.duration * US for s in steps.steps]
    kernels = _tops(top_kernels(c, top_k))
    return TraceReport(
        path=trace.path,
        rank=trace.rank,
        bytes=trace.bytes_read,
        accelerator=accelerator(c),
        steps_incomplete=tuple((s.name, s.duration * US) for s in steps.incomplete),
        steps_dropped=steps.dropped,
        events_dropped=dict(trace.bad_durations),
        gpu_lag=None if steps.gpu_lag is None else steps.gpu_lag * US,
        warnings=_warnings(trace, steps.dropped),
        steps=tuple(
            StepTime(s.name, s.duration * US, {k: v * US for k, v in row.items()})
            for s, row in zip(steps.steps, bd.per_step, strict=True)
        ),
        steps_inferred=steps.inferred,
        step_source=steps.source,
        step_mean=sum(durations) / len(durations) if durations else None,
        step_max=max(durations) if durations else None,
        breakdown={k: bd.ratios[k] for k in CATEGORIES} if durations else {},
        gpu=_gpu_summary(devices),
        devices=tuple({k: (v * US if isinstance(v, float) and k != "overlap" else v)
                       for k, v in asdict(d).items()} for d in devices),
        launch_delay=None if delay is None else {
            "mean": delay.mean * US, "p50": delay.p50 * US, "p99": delay.p99 * US, "max": delay.max * US,
        },
        cpu_seconds=cpu_us * US,
        gpu_seconds=gpu_us * US,
        cpu_gpu_ratio=cpu_us / gpu_us if gpu_us > 0 else None,
        top_ops=_tops(top_ops(c, top_k)),
        top_kernels=kernels,
        annotations=_tops(annotations(c)),
        kernel_stats=tuple(
            {"name": k.name, "count": k.count, "total": k.total * US, "mean": k.mean * US, "min": k.min * US,
             "max": k.max * US, "launched_by": k.launched_by}
            for k in kernel_stats(c, [name for name, _, _ in kernels if name != OTHER])),
        annotation_gpu=_top_annotation_gpu(c, top_k),
        memory_peak=peak_allocated(trace.memory),
        cpu_pids=_cpu_pids(trace),
        in_steps=_in_steps(c, frame) if in_steps else None,
        world_size=trace.world_size,
        backend=trace.backend,
        started_at=_started_at(trace),
    )


EPOCH_PLAUSIBLE = 1e9  # Unix seconds (2001): smaller "dates" are relative clocks


def _started_at(trace: Trace) -> float | None:
    """When the trace starts, in Unix seconds, when its clock is a wall clock."""
    if not len(trace):
        return None
    start = (trace.base_time_ns or 0) * 1e-9 + float(trace.ts.min()) * US
    return start if start >= EPOCH_PLAUSIBLE else None


IN_STEPS_KEPT = 500  # kernels and ops kept per report for a diff (the agent holds one report per rank)


def _in_steps(c: Any, frame: Frame) -> dict[str, dict[str, float]]:
    """The largest IN_STEPS_KEPT kernels and ops, names shortened, the rest summed as "other":
    a hostile trace with a million distinct names must not stay in the agent's memory."""
    def kept(values: dict[str, float]) -> dict[str, float]:
        ranked = sorted(values.items(), key=lambda kv: (-kv[1], kv[0]))
        return fold_top_k(((name, us * US) for name, us in ranked), IN_STEPS_KEPT, limit=IN_STEPS_NAME)

    kernels, ops = totals_in_steps(c, frame.window_union)
    return {"kernels": kept(kernels), "ops": kept(ops)}


IN_STEPS_NAME = 4096  # characters: long C++ kernel names (2,000+) stay whole, a 1 MB name does not


def _top_annotation_gpu(c: Any, k: int) -> dict[str, float]:
    gpu = sorted(annotation_gpu_time(c).items(), key=lambda kv: (-kv[1], kv[0]))
    out = {name: us * US for name, us in gpu[:k]}
    if len(gpu) > k:
        out[OTHER] = sum(us for _, us in gpu[k:]) * US
    return out


# float64 keeps 52 bits: from 2**52 µs on, timestamps are rounded to a microsecond or more
PRECISION_LIMIT_US = float(2**52)


def _warnings(trace: Trace, dropped: int) -> tuple[str, ...]:
    out = []
    if len(trace) and max(abs(float(trace.ts.min())), abs(float(trace.end.max()))) >= PRECISION_LIMIT_US:
        out.append(f"timestamps reach {max(abs(float(trace.ts.min())), abs(float(trace.end.max()))):.3g} µs: "
                   "at that magnitude durations are rounded to a microsecond or more (figures imprecise); "
                   "re-export the trace with relative timestamps (baseTimeNanoseconds)")
    if dropped:
        out.append(f"{dropped} ProfilerStep range(s) of zero or negative length were ignored")
    bad = trace.bad_durations
    if bad:
        causes = ", ".join(f"{n} {BAD_DURATION_WORDS[k]}" for k, n in sorted(bad.items()))
        names = ", ".join(repr(n) for n in trace.bad_duration_names)
        out.append(f"{sum(bad.values())} event(s) left out for a bad duration ({causes}; e.g. {names}): "
                   "the figures exclude them; re-export the trace if the profiler was interrupted")
    return tuple(out)


BAD_DURATION_WORDS = {"missing": "without dur", "negative": "with a negative dur",
                      "non_finite": "with a non-finite dur"}


def _cpu_pids(trace: Trace) -> tuple[int, ...]:
    pids = set(trace.cpu_pids)
    for pid, _ in trace.threads:
        if isinstance(pid, int) and pid not in trace.gpu_devices and pid > 64:
            pids.add(pid)  # GPU "pids" are device indexes (0, 1...), not processes
    return tuple(sorted(pids))


IDLE_CAUSES = {
    "host_wait": "the CPU launched work late (host wait)",
    "kernel_wait": "queued work waited (kernel wait: launch latency, syncs, dependencies)",
    "other": "of gaps no launched work explains (other: gaps ended by device work without a "
             "traced launch, such as DMA or copies without a correlation id, and step ends)",
}


def _idle_finding(g: GpuSummary) -> str:
    """The idle share and its largest cause among all three (other included)."""
    parts = {"host_wait": g.host_wait_ratio, "kernel_wait": g.kernel_wait_ratio, "other": g.idle_other_ratio}
    cause = max(parts, key=lambda k: parts[k])
    rest = ", ".join(f"{k} {v:.1%}" for k, v in parts.items() if k != cause)
    return (f"the GPU is idle {g.idle_ratio:.0%} of step time, mostly because {IDLE_CAUSES[cause]}: "
            f"{parts[cause]:.1%} of step time ({rest})")


def readings(r: TraceReport) -> list[str]:
    """Plain-language readings of the figures, most important first."""
    out: list[str] = []
    out.extend(r.warnings)
    if r.steps_inferred and r.steps:
        out.append("no ProfilerStep in this trace: the whole window is treated as one step "
                   "(take the trace with `profagent trace --iterations N`, which records whole steps)")
    for name, seconds in r.steps_incomplete:
        out.append(f"{name} ({seconds * 1e3:.3f} ms) is incomplete (the profiler stopped inside it): "
                   "excluded from the step figures")
    g = r.gpu
    if g is not None:
        if g.idle_ratio >= 0.3:
            out.append(_idle_finding(g))
        if g.memcpy_share >= 0.1:
            out.append(f"memcpy is {g.memcpy_share:.0%} of GPU time: look at host-device transfers, "
                       "pin memory (pin_memory=True) and use non_blocking copies")
        if g.overlap_ratio is not None and g.overlap_ratio < 0.5:
            out.append(f"only {g.overlap_ratio:.0%} of communication overlaps computation: "
                       "check bucket sizes and that collectives are issued early (DDP/FSDP overlap)")
    elif r.steps:
        out.append("no accelerator activity in this trace (CPU-only, or device tracing was off)")
    if r.cpu_gpu_ratio is not None and r.cpu_gpu_ratio >= 1.5:
        out.append(f"CPU time is {r.cpu_gpu_ratio:.1f}x GPU time: the GPU is starved by the CPU "
                   "(Python overhead, small kernels: try larger batches, CUDA graphs, torch.compile)")
    dl = r.breakdown.get("dataloader", 0.0)
    if dl >= 0.1:
        out.append(f"the DataLoader takes {dl:.0%} of step time: raise num_workers, use "
                   "persistent_workers and prefetching")
    if r.launch_delay is not None and r.launch_delay["p50"] >= 1e-3:
        out.append(f"kernels start {r.launch_delay['p50'] * 1e3:.1f} ms (median) after their launch: "
                   "the launch queue is deep; the CPU runs far ahead, which is fine unless it syncs")
    if r.step_mean and r.step_max and len(r.steps) > 2 and r.step_max > 1.5 * r.step_mean:
        out.append(f"the slowest step takes {r.step_max / r.step_mean:.1f}x the mean: "
                   "look for periodic work (checkpointing, logging, evaluation) or stragglers")
    return out

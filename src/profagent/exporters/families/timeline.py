"""Timeline families: each rank's optimizer steps, step-time histogram, stage seconds and
collective arrival lag, from the kernel probes (no trace needed), and the probes' health.
"""

from __future__ import annotations

from collections.abc import Sequence

from profagent.analysis.timeline import LAG_BUCKETS, STAGES, STEP_BUCKETS
from profagent.contracts import TimelineSnapshot
from profagent.exporters.families import Families

RANK = ("job_id", "rank")


def _cumulative(bounds: Sequence[float], counts: Sequence[int], total: int) -> list[tuple[str, float]]:
    out, running = [], 0
    for bound, n in zip(bounds, counts, strict=True):
        running += n
        out.append((f"{bound:g}", running))
    out.append(("+Inf", total))
    return out


def render(snap: TimelineSnapshot, out: Families) -> None:
    steps = out.counter("profagent_optimizer_steps", "optimizer steps the rank began since the probes were placed: its Optimizer.step calls, else its zero_grad calls or backward passes (/api/ranks step_boundary; kernel uprobes, no trace needed)", RANK)
    hist = out.histogram("profagent_step_seconds", "step time, from one step's start to the next: its Optimizer.step call, else its zero_grad call or backward pass (/api/ranks step_boundary; kernel uprobes)", RANK)
    stages = out.counter("profagent_step_stage_seconds", "seconds of completed steps by stage: data_wait (DataLoader), backward, optimizer (step and zero_grad), other (forward, host work)", (*RANK, "stage"))
    backwards = out.counter("profagent_backward_passes", "backward passes (Engine::execute); above the optimizer steps with gradient accumulation", RANK)
    quantile = out.gauge("profagent_step_window_seconds", "step time over the timeline window (timeline.window_seconds): p50, p90 and max", (*RANK, "stat"))
    rate = out.gauge("profagent_steps_per_second", "steps per second over the timeline window", RANK)
    micro = out.gauge("profagent_step_micro_batches", "backward passes per step over the timeline window", RANK)
    lag = out.histogram("profagent_collective_arrival_lag_seconds", "how long after the job's first rank this rank called each collective (kernel uprobes)", RANK)
    for r in snap.ranks:
        labels = [r.job_id, r.rank]
        steps.add_metric(labels, r.optimizer_steps)
        hist.add_metric(labels, _cumulative(STEP_BUCKETS, r.step_buckets, r.steps_total), r.step_seconds_sum)
        for stage in STAGES:
            stages.add_metric([*labels, stage], r.stage_seconds.get(stage, 0.0))
        backwards.add_metric(labels, r.backwards_total)
        for stat, value in (("p50", r.p50), ("p90", r.p90), ("max", r.max)):
            if value is not None:
                quantile.add_metric([*labels, stat], value)
        if r.steps_per_second is not None:
            rate.add_metric(labels, r.steps_per_second)
        if r.micro_batches is not None:
            micro.add_metric(labels, r.micro_batches)
        if r.lag_count:
            lag.add_metric(labels, _cumulative(LAG_BUCKETS, r.lag_buckets, r.lag_count), r.lag_seconds_sum)
    events = out.counter("profagent_timeline_events", "probe events read: ranked (from an observed rank), foreign (another process mapping the same libtorch), lost (the ring buffer was full)", ("kind",))
    events.add_metric(["ranked"], snap.events_total)
    events.add_metric(["foreign"], snap.events_foreign)
    events.add_metric(["lost"], snap.events_lost)
    probes = out.gauge("profagent_timeline_probes", "probes placed per probed library (by build id)", ("build_id",))
    for lib in snap.libraries:
        probes.add_metric([lib.build_id[:40] or "none"], len(lib.probes))

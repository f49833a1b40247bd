"""Every analyzer of analysis/findings over hand-built snapshots, with an injected clock."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from profagent.analysis.findings import KINDS, FindingsSnapshot
from profagent.analysis.findings.evaluate import Evaluator
from profagent.analysis.findings.hang import hang
from profagent.analysis.findings.history import CountsWindow, MemorySeries
from profagent.analysis.stacks import CATEGORIES, parse_frame
from profagent.analysis.trace.report import TraceReport
from profagent.config import FindingsConfig
from profagent.sources.gpu.source import GpuDevice, GpuSnapshot, ProcessGpuUsage
from profagent.sources.host import GroupUsage, HostSnapshot, NodeUsage, Usage
from profagent.sources.stacks.source import RankStall, StackGroup, StacksSnapshot
from profagent.sources.traces.source import RankTrace, TracesSnapshot

MAIN = ("<module> (train.py:80)", "main (train.py:70)")
IN_ALL_REDUCE = (*MAIN, "wrapper (torch/distributed/c10d_logger.py:81)",
                 "all_reduce (torch/distributed/distributed_c10d.py:3252)")
AT_LINE_68 = ("<module> (train.py:80)", "main (train.py:68)")
GIB = 1 << 30


def frames(*names: str) -> tuple:
    return tuple(parse_frame(n) for n in names)


def stall(rank: str, stalled: bool, stack: tuple[str, ...], seconds: float = 130.0) -> RankStall:
    return RankStall(rank, stalled, seconds, "job", frames(*stack))


def stacks(*stalls: RankStall, groups: tuple[StackGroup, ...] = ()) -> StacksSnapshot:
    return StacksSnapshot("job", groups, stalls, ())


def group(rank: str, **shares: int) -> StackGroup:
    cats = tuple((c, shares.get(c, 0)) for c in CATEGORIES)
    return StackGroup(rank, "main", cats, (("fetch (fetch.py)", 10), ("other", 3)), (), job_id="job")


# -- hang -------------------------------------------------------------------------------

def test_hang_names_the_rank_outside_the_collective_with_its_line() -> None:
    [f] = hang([stall("0", True, IN_ALL_REDUCE), stall("1", True, AT_LINE_68)], "job")
    assert (f.finding, f.rank, f.severity) == ("hang", "1", "critical")
    assert "rank 1 at main (train.py:68)" in f.summary
    assert "all_reduce (torch/distributed/distributed_c10d.py:3252)" in f.summary
    assert f.evidence["culprit_ranks"] == ["1"] and f.evidence["waiting_ranks"] == ["0"]
    assert f.evidence["called_at"] == "main (train.py:70)"
    assert f.evidence["stacks"]["1"][-1] == "main (train.py:68)"


def test_hang_culprit_may_be_busy_not_stalled() -> None:
    [f] = hang([stall("0", True, IN_ALL_REDUCE), stall("1", False, AT_LINE_68, 3)], "job")
    assert f.rank == "1" and "train.py:68" in f.summary


def test_every_rank_in_the_same_collective_points_elsewhere() -> None:
    [f] = hang([stall("0", True, IN_ALL_REDUCE), stall("1", True, IN_ALL_REDUCE)], "job")
    assert f.rank is None and f.evidence["culprit_ranks"] == []
    assert "every rank" in f.summary and "another node" in f.summary
    assert "all_reduce" in f.summary and "train.py:70" in f.summary


def test_different_collectives_are_a_mismatch() -> None:
    other = (*MAIN[:1], "main (train.py:75)", "broadcast (torch/distributed/distributed_c10d.py:2700)")
    [f] = hang([stall("0", True, IN_ALL_REDUCE), stall("1", True, other)], "job")
    assert "different collectives" in f.summary and "broadcast" in f.summary


def test_stall_outside_collectives_and_no_stall() -> None:
    [f] = hang([stall("0", True, AT_LINE_68)], "job")
    assert f.rank == "0" and "not in a collective" in f.summary
    assert hang([stall("0", False, IN_ALL_REDUCE), stall("1", False, AT_LINE_68)], "job") == []


# -- evaluator: since, clearing, shares ----------------------------------------------------

def cfg(**kw: float) -> FindingsConfig:
    base = dict(window_seconds=60.0, min_samples=40, compile_grace_seconds=100.0, gpu_idle_seconds=30.0,
                leak_min_span_seconds=60.0, leak_window_seconds=600.0)
    base.update(kw)
    return FindingsConfig(**base)  # type: ignore[arg-type]


def test_since_is_kept_while_active_and_cleared_with_the_evidence() -> None:
    ev = Evaluator(cfg())
    hung = {"stacks": stacks(stall("0", True, IN_ALL_REDUCE), stall("1", True, AT_LINE_68))}
    first = ev.evaluate(hung, now=1000.0)
    assert isinstance(first, FindingsSnapshot) and first.time == 1000.0
    assert [f.since for f in first.findings] == [1000.0]
    hung2 = {"stacks": stacks(stall("0", True, IN_ALL_REDUCE, 140), stall("1", True, AT_LINE_68, 140))}
    assert [f.since for f in ev.evaluate(hung2, now=1010.0).findings] == [1000.0]
    moving = {"stacks": stacks(stall("0", False, IN_ALL_REDUCE, 0), stall("1", False, AT_LINE_68, 0))}
    assert ev.evaluate(moving, now=1020.0).findings == ()
    assert [f.since for f in ev.evaluate(hung2, now=1030.0).findings] == [1030.0]


def feed_shares(ev: Evaluator, per_rank: dict[str, dict[str, int]], ticks: int, start: float = 0.0,
                step: float = 5.0) -> FindingsSnapshot:
    """Cumulative counters growing by ``per_rank`` every ``step`` seconds."""
    snap = FindingsSnapshot()
    for i in range(1, ticks + 1):
        groups = tuple(group(r, **{c: n * i for c, n in d.items()}) for r, d in per_rank.items())
        snap = ev.evaluate({"stacks": stacks(groups=groups)}, now=start + i * step)
    return snap


def test_dataloader_bound_from_main_thread_share() -> None:
    ev = Evaluator(cfg())
    snap = feed_shares(ev, {"0": {"dataloader": 60, "forward": 40}, "1": {"forward": 80, "backward": 20}}, 3)
    assert [(f.finding, f.rank) for f in snap.findings] == [("dataloader_bound", "0")]
    f = snap.findings[0]
    assert f.evidence["share"] == 0.6 and f.evidence["samples"] == 200  # 2 windows of deltas
    assert "fetch (fetch.py): 10" in f.evidence["top_functions"]


def test_too_few_samples_judge_nothing() -> None:
    ev = Evaluator(cfg())
    assert feed_shares(ev, {"0": {"dataloader": 10}}, 3).findings == ()


def test_host_sync_and_optimizer_bound() -> None:
    ev = Evaluator(cfg())
    snap = feed_shares(ev, {"0": {"host_sync": 50, "forward": 50}, "1": {"optimizer": 70, "forward": 30}}, 3)
    assert {(f.finding, f.rank) for f in snap.findings} == {("host_sync_bound", "0"), ("optimizer_bound", "1")}


def test_window_forgets_old_samples() -> None:
    ev = Evaluator(cfg(window_seconds=20.0))
    feed_shares(ev, {"0": {"dataloader": 100}}, 3)  # t = 5..15
    groups = tuple(group("0", dataloader=300, forward=100 * k) for k in range(1, 7))
    snap = FindingsSnapshot()
    for i, g in enumerate(groups):  # t = 20..45: only forward grows
        snap = ev.evaluate({"stacks": stacks(groups=(g,))}, now=20.0 + 5 * i)
    assert snap.findings == ()


def test_compile_storm_only_after_grace() -> None:
    ev = Evaluator(cfg(compile_grace_seconds=100.0))
    assert feed_shares(ev, {"0": {"compile": 50, "forward": 50}}, 10).findings == ()  # t <= 50
    snap = feed_shares(ev, {"0": {"compile": 50, "forward": 50}}, 40)  # same counters, up to t=200
    assert [f.finding for f in snap.findings] == ["compile_storm"]


def test_straggler_from_collective_share_not_while_hung() -> None:
    ev = Evaluator(cfg())
    snap = feed_shares(ev, {"0": {"collective": 60, "forward": 40}, "1": {"collective": 5, "other": 95},
                            "2": {"collective": 55, "forward": 45}}, 3)
    [f] = snap.findings
    assert (f.finding, f.rank) == ("straggler", "1")
    assert f.evidence["others_median_collective_share"] == 0.575 and "other (95%)" in f.summary
    # The same shares in a hung job: the hang explains it, not a straggler.
    groups = tuple(group(r, collective=60 * 4, forward=40 * 4) for r in ("0", "2")) + (group("1", other=400),)
    hung = stacks(stall("0", True, IN_ALL_REDUCE), stall("1", True, AT_LINE_68), groups=groups)
    assert [f.finding for f in ev.evaluate({"stacks": hung}, now=20.0).findings] == ["hang"]


def report(step: float, dataloader: float = 0.0) -> TraceReport:
    return TraceReport(
        path=f"/t/{step}.json", rank=None, bytes=1, steps=(), steps_inferred=False, step_mean=step,
        step_max=step, breakdown={"dataloader": dataloader, "cpu_exec": 1 - dataloader}, gpu=None, devices=(),
        launch_delay=None, cpu_seconds=0, gpu_seconds=0, cpu_gpu_ratio=None, top_ops=(), top_kernels=(),
        annotations=(), memory_peak={}, cpu_pids=(), accelerator=None, step_source="profiler_step",
        steps_incomplete=(), steps_dropped=0, gpu_lag=None, warnings=(),
    )


def test_straggler_and_dataloader_from_traces() -> None:
    traces = TracesSnapshot("job", (RankTrace("0", report(0.100), 1.0), RankTrace("1", report(0.150, 0.5), 1.0),
                                    RankTrace("2", report(0.105), 1.0)), (), 0)
    snap = Evaluator(cfg()).evaluate({"traces": traces}, now=10.0)
    assert {(f.finding, f.rank) for f in snap.findings} == {("straggler", "1"), ("dataloader_bound", "1")}
    straggler = next(f for f in snap.findings if f.finding == "straggler")
    assert abs(straggler.evidence["others_median_seconds"] - 0.1025) < 1e-12 and "1.5x" in straggler.summary
    even = TracesSnapshot("job", (RankTrace("0", report(0.100), 1.0), RankTrace("1", report(0.110), 1.0)), (), 0)
    assert Evaluator(cfg()).evaluate({"traces": even}, now=10.0).findings == ()


def test_a_trace_without_steps_is_no_straggler() -> None:
    """An on-demand trace with no ProfilerStep nor optimizer step is one window-long "step"
    (steps_inferred): 1 s against the other rank's 40 ms steps is not a straggler."""
    window = dataclasses.replace(report(1.0), steps_inferred=True, step_source="window")
    traces = TracesSnapshot("job", (RankTrace("0", window, 1.0), RankTrace("1", report(0.040), 1.0)), (), 0)
    assert not [f for f in Evaluator(cfg()).evaluate({"traces": traces}, now=10.0).findings if f.finding == "straggler"]
    stepped = TracesSnapshot("job", (RankTrace("0", report(1.0), 1.0), RankTrace("1", report(0.040), 1.0)), (), 0)
    assert [f.rank for f in Evaluator(cfg()).evaluate({"traces": stepped}, now=10.0).findings if f.finding == "straggler"] == ["0"]


# -- memory --------------------------------------------------------------------------------

def host(rss: int, worker_uss: int | None, worker_rss: int, available: int) -> HostSnapshot:
    return HostSnapshot(
        (GroupUsage("job", "0", "main", 1, Usage(rss=rss)),
         GroupUsage("job", "0", "dataloader", 2, Usage(rss=worker_rss, uss=worker_uss))),
        NodeUsage(0.5, 16 * GIB, available, 8),
    )


def test_host_leak_rate_and_time_to_exhaustion_from_worker_uss() -> None:
    ev = Evaluator(cfg())
    rate = 4 << 20  # 4 MiB/s in the workers' USS; their RSS (shared pages) stays flat
    snap = FindingsSnapshot()
    for t in range(0, 121, 5):
        snap = ev.evaluate({"host": host(GIB, (100 << 20) + rate * t, 900 << 20,
                                         8 * GIB - rate * t)}, now=float(t))
    [f] = snap.findings
    assert (f.finding, f.rank, f.evidence["kind"]) == ("memory_leak", "0", "host")
    assert f.evidence["growth_bytes_per_second"] == rate
    assert "USS" in f.summary and "DataLoader" in f.summary
    expected = (8 * GIB - rate * 120) / rate  # ~ 31 min left: within a quarter of 4 h -> critical
    assert abs(f.evidence["seconds_to_exhaustion"] - expected) < 1 and f.severity == "critical"


def test_no_leak_before_min_span_or_when_flat_or_noisy() -> None:
    ev = Evaluator(cfg())
    for t in range(0, 55, 5):  # steep growth but only 50 s of history
        snap = ev.evaluate({"host": host(GIB + (8 << 20) * t, None, 0, 8 * GIB)}, now=float(t))
    assert snap.findings == ()
    ev = Evaluator(cfg())
    for t in range(0, 300, 5):  # sawtooth: allocator caching, no trend
        snap = ev.evaluate({"host": host(GIB + (t % 20) * (50 << 20), None, 0, 8 * GIB)}, now=float(t))
    assert snap.findings == ()


def gpu(util: float, memory: int, free: int, reasons: dict[str, bool] | None = None,
        xids: dict[int, int] | None = None, ecc: float = 0.0) -> GpuSnapshot:
    dev = GpuDevice(0, "GPU-a", "H100", "0000:01:00.0", "disabled", True,
                    MappingProxyType({"utilization_ratio": util, "memory_free_bytes": free,
                                      "ecc_uncorrected_errors": ecc, "temperature_celsius": 91.0}),
                    MappingProxyType(reasons or {}), MappingProxyType(xids or {}))
    proc = ProcessGpuUsage("job", "0", "main", 0, "GPU-a", "", 1, memory, None, None)
    return GpuSnapshot("job", True, "550", "12", "12.4", (dev,), (proc,))


def test_gpu_idle_needs_to_last_and_says_what_the_cpu_does() -> None:
    ev = Evaluator(cfg(gpu_idle_seconds=30.0))
    for t in range(0, 35, 5):
        g = group("0", dataloader=80 * (t + 1), forward=20 * (t + 1))
        snap = ev.evaluate({"gpu": gpu(0.02, GIB, 70 * GIB), "stacks": stacks(groups=(g,))}, now=float(t))
        if t < 30:
            assert "gpu_idle" not in [f.finding for f in snap.findings]
    idle = next(f for f in snap.findings if f.finding == "gpu_idle")
    assert idle.since == 0.0 and "dataloader (80%)" in idle.summary
    busy = ev.evaluate({"gpu": gpu(0.9, GIB, 70 * GIB)}, now=40.0)
    assert "gpu_idle" not in [f.finding for f in busy.findings]


def test_gpu_memory_leak_throttling_and_errors() -> None:
    ev = Evaluator(cfg())
    for t in range(0, 125, 5):
        snap = ev.evaluate({"gpu": gpu(0.9, GIB + (32 << 20) * t, 10 * GIB - (32 << 20) * t,
                                       {"hw_thermal_slowdown": True, "gpu_idle": False})}, now=float(t))
    kinds = {f.finding: f for f in snap.findings}
    assert kinds["memory_leak"].evidence["kind"] == "gpu" and kinds["memory_leak"].severity == "critical"
    assert kinds["gpu_throttled"].severity == "warning" and "hw_thermal_slowdown" in kinds["gpu_throttled"].summary
    assert "gpu_errors" not in kinds
    snap = ev.evaluate({"gpu": gpu(0.9, GIB, 10 * GIB, xids={79: 1}, ecc=2)}, now=130.0)
    err = next(f for f in snap.findings if f.finding == "gpu_errors")
    assert err.severity == "critical" and err.evidence["errors"] == {"xid 79": 1, "ecc_uncorrected": 2}
    # Cleared once no new error came for gpu_errors_seconds.
    later = ev.evaluate({"gpu": gpu(0.9, GIB, 10 * GIB, xids={79: 1}, ecc=2)}, now=130.0 + 700)
    assert "gpu_errors" not in [f.finding for f in later.findings]


def test_every_kind_is_documented_and_results_are_ranked() -> None:
    from helpers.paths import ROOT

    doc = (ROOT / "docs" / "diagnosis.md").read_text()
    for kind in KINDS:
        assert f"`{kind}`" in doc, kind


def test_histories() -> None:
    w = CountsWindow(10.0)
    w.add(0, {"a": 1})
    w.add(5, {"a": 3})
    w.add(12, {"a": 10})
    assert w.delta() == {"a": 9}  # base = the reading at t=0, the last at or before 12 - 10
    w.add(16, {"a": 12})
    assert w.delta() == {"a": 9}  # base = the reading at t=5 now
    w.add(13, {"a": 2})  # a counter went back: start over
    assert w.delta() == {}
    m = MemorySeries(100.0)
    for t in range(5):
        m.add(t, 10 + 3 * t)
    assert m.fit() == (3.0, 1.0) and m.span == 4

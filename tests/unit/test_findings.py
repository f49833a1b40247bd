"""Every analyzer of analysis/findings over hand-built snapshots, with an injected clock."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

from profagent.analysis.findings import FINDING_KINDS
from profagent.analysis.findings.evaluate import Evaluator
from profagent.analysis.findings.hang import hang
from profagent.analysis.findings.history import CountsWindow, MemorySeries
from profagent.analysis.stacks import CATEGORIES, parse_frame
from profagent.config import FindingsConfig
from profagent.contracts import (
    Finding,
    FindingsSnapshot,
    GpuDevice,
    GpuSnapshot,
    GroupUsage,
    HostSnapshot,
    NodeUsage,
    ProcessGpuUsage,
    RankStall,
    RankTrace,
    StackGroup,
    StacksSnapshot,
    TraceReport,
    TracesSnapshot,
    Usage,
)

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
    assert f.summary.startswith("rank 1 holds the job up, not in a collective: rank 1 at main (train.py:68)")
    assert "rank 0 waits in all_reduce (torch/distributed/distributed_c10d.py:3252) called at main (train.py:70)" \
        in f.summary
    assert f.evidence["culprit_ranks"] == ["1"] and f.evidence["waiting_ranks"] == ["0"]
    assert f.evidence["called_at"] == "main (train.py:70)" and f.evidence["diagnosis"] == "culprit"
    assert f.evidence["stacks"]["1"][-1] == "main (train.py:68)"
    assert f.evidence["roles"]["0"]["role"] == "waiting" and f.evidence["roles"]["1"] == {
        "role": "culprit", "stalled": True, "at": "main (train.py:68)", "innermost": "main (train.py:68)",
        "collective": None, "native_frames": False, "location": "train.py:68"}
    assert f.evidence["roles"]["0"]["location"] == "train.py:70"  # the line that called the collective


IN_BACKWARD = (*MAIN, "Tensor.backward (torch/_tensor.py:623)", "backward (torch/autograd/__init__.py:395)",
               "_engine_run_backward (torch/autograd/graph.py:979)")
REDUCER_NATIVE = (*IN_BACKWARD, "THPEngine_run_backward (libtorch_python.so)",
                  "c10d::Reducer::finalize_backward (libtorch_cpu.so)", "std::condition_variable::wait (libstdc++.so.6)",
                  "pthread_cond_wait (libc.so.6)")


def test_plain_ddp_rank_waiting_in_the_reducer_is_a_victim_from_its_native_frames() -> None:
    victim = RankStall("0", True, 130.0, "job", frames(*IN_BACKWARD), native=frames(*REDUCER_NATIVE))
    [f] = hang([victim, stall("1", True, AT_LINE_68)], "job")
    assert f.rank == "1" and f.evidence["culprit_ranks"] == ["1"] and f.evidence["waiting_ranks"] == ["0"]
    assert "rank 0 waits in all_reduce from backward (DDP's reducer) called at main (train.py:70)" in f.summary
    assert f.evidence["roles"]["0"]["native_frames"] is True
    assert f.evidence["stacks"]["0"][-3] == "c10d::Reducer::finalize_backward (libtorch_cpu.so)"
    # Without its native frames the same rank looks stuck in backward: the finding waits for them
    pending = RankStall("0", True, 130.0, "job", frames(*IN_BACKWARD), native_pending=True)
    assert hang([pending, stall("1", True, AT_LINE_68)], "job") == []
    # ... also while that rank only stands still, short of its own stall_seconds (it blocked
    # after the culprit stopped): the first verdict names it waiting, not a lone stuck rank
    standing = RankStall("0", False, 8.0, "job", frames(*IN_BACKWARD), suspected=True, native_pending=True)
    assert hang([standing, stall("1", True, AT_LINE_68, 10.5)], "job") == []
    standing = RankStall("0", False, 8.0, "job", frames(*IN_BACKWARD), suspected=True, native=frames(*REDUCER_NATIVE))
    [f] = hang([standing, stall("1", True, AT_LINE_68, 10.5)], "job")
    assert f.evidence["diagnosis"] == "culprit" and f.evidence["waiting_ranks"] == ["0"] and f.rank == "1"
    # ... or none yet, its state from before it blocked (a native window in flight, for
    # seconds, updates nothing): the first verdict waits for it too
    frozen = RankStall("0", False, 0.0, "job", frames(*IN_BACKWARD), native_pending=True)
    assert hang([frozen, stall("1", True, AT_LINE_68, 10.5)], "job") == []
    # once a verdict is out, a native window in flight (a periodic one) never takes it back
    [f] = hang([frozen, stall("1", True, AT_LINE_68, 10.5)], "job", settled=True)
    assert f.evidence["diagnosis"] == "stuck" and f.evidence["culprit_ranks"] == ["1"]
    # ... even one whose stack from before shows it waiting in a collective: on a loaded node
    # a native window may run for 20 s, and a culprit caught in backward just before it stopped
    # would make "every rank waits" of a job that one rank holds up
    stale = RankStall("1", False, 0.0, "job", frames(*IN_BACKWARD), native=frames(*REDUCER_NATIVE),
                      native_pending=True)
    blocked = RankStall("0", True, 22.0, "job", frames(*IN_BACKWARD), native=frames(*REDUCER_NATIVE))
    assert hang([blocked, stale], "job") == []
    [f] = hang([blocked, stall("1", True, AT_LINE_68, 12.0)], "job")
    assert f.evidence["diagnosis"] == "culprit" and f.rank == "1" and f.evidence["waiting_ranks"] == ["0"]
    # the culprit's own later native windows (every stall_seconds / 2; under load one after
    # the other) never hold the first verdict back
    relooked = RankStall("1", True, 30.0, "job", frames(*AT_LINE_68), native=frames(*AT_LINE_68), native_pending=True)
    victim = RankStall("0", True, 29.0, "job", frames(*IN_BACKWARD), native=frames(*REDUCER_NATIVE))
    [f] = hang([victim, relooked], "job")
    assert f.evidence["diagnosis"] == "culprit" and f.rank == "1"
    # ... except a stalled rank's first native frames, which may still change its role
    first = RankStall("0", True, 130.0, "job", frames(*IN_BACKWARD), native_pending=True)
    assert hang([first, stall("1", True, AT_LINE_68)], "job", settled=True) == []
    # ... and if none come (native off or failed), both ranks are said to be stuck: one finding
    [f] = hang([RankStall("0", True, 130.0, "job", frames(*IN_BACKWARD)), stall("1", True, AT_LINE_68)], "job")
    assert f.rank is None and f.evidence["diagnosis"] == "stuck" and f.evidence["culprit_ranks"] == ["0", "1"]
    assert f.summary.startswith("ranks 0, 1 are stuck, not in a collective")


def test_a_rank_standing_in_a_collective_is_a_victim_before_its_own_stall_seconds() -> None:
    waiting = RankStall("0", False, 8.0, "job", frames(*IN_ALL_REDUCE), suspected=True)
    [f] = hang([waiting, stall("1", True, AT_LINE_68, 10.5)], "job")
    assert f.rank == "1" and f.evidence["diagnosis"] == "culprit" and f.evidence["waiting_ranks"] == ["0"]
    passing = RankStall("0", False, 0.0, "job", frames(*IN_ALL_REDUCE))  # only passing through it
    [f] = hang([passing, stall("1", True, AT_LINE_68, 10.5)], "job")
    assert f.evidence["diagnosis"] == "stuck" and f.evidence["waiting_ranks"] == [] and f.rank == "1"


def test_hang_culprit_may_be_busy_not_stalled() -> None:
    [f] = hang([stall("0", True, IN_ALL_REDUCE), stall("1", False, AT_LINE_68, 3)], "job")
    assert f.rank == "1" and "train.py:68" in f.summary


def test_every_rank_in_the_same_collective_points_elsewhere() -> None:
    [f] = hang([stall("0", True, IN_ALL_REDUCE), stall("1", True, IN_ALL_REDUCE)], "job")
    assert f.rank is None and f.evidence["culprit_ranks"] == [] and f.evidence["diagnosis"] == "all_waiting"
    assert "every rank" in f.summary and "another node" in f.summary
    assert "all_reduce" in f.summary and "train.py:70" in f.summary


def test_different_collectives_are_one_collective_mismatch_naming_each() -> None:
    other = (*MAIN[:1], "main (train.py:75)", "broadcast (torch/distributed/distributed_c10d.py:2700)")
    [f] = hang([stall("0", True, IN_ALL_REDUCE), stall("1", True, other)], "job")
    assert f.rank is None and f.evidence["diagnosis"] == "collective_mismatch"
    assert f.summary.startswith("collective mismatch")
    assert "rank 0 waits in all_reduce (torch/distributed/distributed_c10d.py:3252) called at main (train.py:70)" \
        in f.summary
    assert "rank 1 waits in broadcast (torch/distributed/distributed_c10d.py:2700) called at main (train.py:75)" \
        in f.summary
    # a plain DDP rank in backward's all_reduce and another in a broadcast: a mismatch too
    victim = RankStall("0", True, 130.0, "job", frames(*IN_BACKWARD), native=frames(*REDUCER_NATIVE))
    [f] = hang([victim, stall("1", True, other)], "job")
    assert f.evidence["diagnosis"] == "collective_mismatch" and "all_reduce from backward" in f.summary


def test_stall_outside_collectives_and_no_stall() -> None:
    [f] = hang([stall("0", True, AT_LINE_68)], "job")
    assert f.rank == "0" and "not in a collective" in f.summary and f.summary.startswith("rank 0 is stuck")
    assert hang([stall("0", False, IN_ALL_REDUCE), stall("1", False, AT_LINE_68)], "job") == []


# -- evaluator: since, clearing, shares ----------------------------------------------------

def cfg(**kw: float) -> FindingsConfig:
    # each analyzer's verdict at once: the straggler's confirmation has its own tests (test_steady.py)
    base = dict(window_seconds=60.0, min_samples=40, compile_grace_seconds=100.0, gpu_idle_seconds=30.0,
                leak_min_span_seconds=60.0, leak_window_seconds=600.0, straggler_confirm_seconds=0.0)
    base.update(kw)
    return FindingsConfig(**base)


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


def test_the_first_hang_verdict_waits_for_native_frames_in_flight_then_holds() -> None:
    """Rank 1 stopped; rank 0's native window is in flight, its last state from before it
    blocked. The first verdict waits for it (rank 0 then named waiting in DDP's reducer);
    later native windows in flight never take the finding back."""
    ev = Evaluator(cfg())
    culprit = stall("1", True, AT_LINE_68, 10.5)
    frozen = RankStall("0", False, 0.0, "job", frames(*IN_BACKWARD), native_pending=True)
    assert ev.evaluate({"stacks": stacks(frozen, culprit)}, now=1000.0).findings == ()
    victim = RankStall("0", False, 4.0, "job", frames(*IN_BACKWARD), suspected=True, native=frames(*REDUCER_NATIVE))
    [f] = ev.evaluate({"stacks": stacks(victim, culprit)}, now=1001.0).findings
    assert f.evidence["diagnosis"] == "culprit" and f.evidence["waiting_ranks"] == ["0"] and f.since == 1001.0
    again = dataclasses.replace(victim, native_pending=True, native=())  # its next native window, in flight
    [f] = ev.evaluate({"stacks": stacks(again, culprit)}, now=1002.0).findings
    assert f.finding == "hang" and f.since == 1001.0


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
    ev = Evaluator(cfg(window_seconds=20.0, hold_seconds=0.0))  # the window alone (the hold: test_steady)
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


def judged(rank: str, waits: float, n: int, **shares: int) -> StackGroup:
    g = group(rank, **shares)
    return StackGroup(g.rank, g.role, g.categories, g.functions, g.threads, g.job_id, judged=n, collective_wait=waits)


def feed_waits(ev: Evaluator, per_rank: dict[str, tuple[float, dict[str, int]]], ticks: int, start: float = 0.0,
               step: float = 5.0, stall_rows: tuple[RankStall, ...] = (),
               run_queue: dict[str, float] | None = None) -> FindingsSnapshot:
    """Every ``step`` s each rank's judged samples grow by 100, its waits by ``share`` x 100
    (and, with ``run_queue``, the host source says its main thread waited that share of the
    ``step`` for a CPU)."""
    snap = FindingsSnapshot()
    for i in range(1, ticks + 1):
        groups = tuple(judged(r, share * 100 * i, 100 * i, **{c: n * i for c, n in d.items()})
                       for r, (share, d) in per_rank.items())
        snapshots = {"stacks": stacks(*stall_rows, groups=groups)}
        if run_queue:
            snapshots["host"] = HostSnapshot(
                tuple(GroupUsage("job", r, "main", 1, Usage(run_queue=100.0 + q * step * i)) for r, q in run_queue.items()),
                NodeUsage(0.5, 16 * GIB, 8 * GIB, 8))
        snap = ev.evaluate(snapshots, now=start + i * step)
    return snap


STRAGGLER_JOB = {"0": (0.6, {"backward": 60, "forward": 40}), "1": (0.05, {"backward": 50, "forward": 50}),
                 "2": (0.55, {"backward": 55, "forward": 45})}


def test_straggler_is_the_rank_that_waits_least_once_every_rank_is_warmed_up() -> None:
    ev = Evaluator(cfg(window_seconds=20.0))
    assert feed_waits(ev, STRAGGLER_JOB, 4).findings == ()  # t = 5..20: not a full judged window yet
    snap = feed_waits(ev, STRAGGLER_JOB, 6)  # t = 25, 30: a full window (20 s) of judged samples
    [f] = snap.findings
    assert (f.finding, f.rank) == ("straggler", "1")
    assert f.evidence["others_median_collective_share"] == 0.575 and f.evidence["collective_share"] == 0.05
    assert f.evidence["signal"] == "stacks" and "forward (50%)" in f.summary
    assert sorted(snap.wait_shares) == [("job", "0", 0.6), ("job", "1", 0.05), ("job", "2", 0.55)]
    assert snap.evaluations == 10


def test_a_gap_alone_is_no_straggler_when_every_rank_waits_a_lot() -> None:
    """Shares measured on a loaded node (two plain DDP jobs and stress-ng on 2 cores): gloo's
    transfers wait for a CPU on every rank, so a healthy job's ranks drifted 24 points apart
    (0.61, 0.375), as far as a rank doing twice the others' work (0.55, 0.31). A straggler
    also waits at most half the others' median: neither is named; a rank doing three times
    the work, once its share fell to 0.3 against 0.66, is."""
    def found(rank0: float, rank1: float) -> list[tuple[str, str | None]]:
        steps = {"backward": 60, "forward": 40}
        snap = feed_waits(Evaluator(cfg(window_seconds=20.0)), {"0": (rank0, steps), "1": (rank1, steps)}, 6)
        return [(f.finding, f.rank) for f in snap.findings]

    assert found(0.614, 0.375) == [] and found(0.55, 0.31) == []
    assert found(0.66, 0.3) == [("straggler", "1")]


def test_a_straggler_slowed_by_cpu_contention_says_so() -> None:
    """A rank whose main thread waited for a CPU (schedstat's run queue) at least
    findings.contention_share of the window: on a loaded node ranks slow unevenly, and a
    balanced job's ranks were measured 0.26 against 0.59 apart (docs/diagnosis.md). The
    finding stays, and names the node as a possible cause only when the node's other ranks
    wait for a CPU too (their median at least half its own wait); a rank that barely queued
    is not said to be contended, nor one whose run queue was never read."""
    def straggler(run_queue: dict[str, float] | None) -> Finding:
        [f] = feed_waits(Evaluator(cfg(window_seconds=20.0)), STRAGGLER_JOB, 6, run_queue=run_queue).findings
        assert (f.finding, f.rank) == ("straggler", "1")
        return f

    f = straggler({"0": 0.18, "1": 0.22, "2": 0.15})
    assert f.evidence["cpu_contended"] and f.evidence["run_queue_shares"] == {"0": 0.18, "1": 0.22, "2": 0.15}
    assert "waits for a CPU 22% of the time" in f.summary and "may be the node" in f.summary
    # it queues 45 %, its node-mates 22 %: it waits for a CPU because it computes more
    f = straggler({"0": 0.22, "1": 0.45, "2": 0.2})
    assert not f.evidence["cpu_contended"] and "CPU" not in f.summary
    f = straggler({"0": 0.25, "1": 0.45, "2": 0.3})  # the others wait comparably: the node
    assert f.evidence["cpu_contended"] and "may be the node" in f.summary
    f = straggler({"0": 0.3, "1": 0.03, "2": 0.3})  # the others queue, it barely does: the rank
    assert not f.evidence["cpu_contended"] and "CPU" not in f.summary
    f = straggler(None)
    assert f.evidence["run_queue_shares"] == {} and not f.evidence["cpu_contended"]


def test_no_straggler_while_a_rank_compiles_or_has_not_been_judged() -> None:
    ev = Evaluator(cfg(window_seconds=20.0))
    compiling = {**STRAGGLER_JOB, "1": (0.05, {"compile": 70, "forward": 30})}
    assert feed_waits(ev, compiling, 8).findings == ()
    ev = Evaluator(cfg(window_seconds=20.0))
    snap = FindingsSnapshot()
    for i in range(1, 9):  # rank 1 still importing: no native window yet, nothing judged
        groups = (judged("0", 60 * i, 100 * i, backward=100 * i), group("1", other=100 * i))
        snap = ev.evaluate({"stacks": stacks(groups=groups)}, now=5.0 * i)
    assert snap.findings == () and [r for _, r, _ in snap.wait_shares] == ["0"]


def test_no_straggler_while_a_hang_is_suspected_nor_once_it_is_declared() -> None:
    ev = Evaluator(cfg(window_seconds=20.0))
    suspected = (RankStall("1", False, 6.0, "job", frames(*AT_LINE_68), suspected=True),
                 RankStall("0", False, 0.0, "job", frames(*IN_ALL_REDUCE)))
    assert feed_waits(ev, STRAGGLER_JOB, 8, stall_rows=suspected).findings == ()
    hung = (stall("0", True, IN_ALL_REDUCE), stall("1", True, AT_LINE_68))
    assert [f.finding for f in feed_waits(ev, STRAGGLER_JOB, 9, stall_rows=hung).findings] == ["hang"]
    # an agent restarted during the hang starts over: still no straggler, and the hang again
    ev = Evaluator(cfg(window_seconds=20.0))
    for ticks in range(1, 10):
        rows = suspected if ticks < 6 else hung
        assert "straggler" not in [f.finding for f in feed_waits(ev, STRAGGLER_JOB, ticks, stall_rows=rows).findings]


def test_a_held_straggler_outlasts_a_moment_of_suspicion_but_not_a_frozen_rank() -> None:
    """A rank waiting for the straggler can stand at one collective for a whole short window
    (a suspicion): the analyzers pause, the held straggler stays. A rank frozen for 30 s (the
    job-level rule's gate too) may be hanging: the straggler goes at once."""
    ev = Evaluator(cfg(window_seconds=20.0))
    assert [f.rank for f in feed_waits(ev, STRAGGLER_JOB, 6).findings] == ["1"]

    def tick(i: int, *rows: RankStall) -> list[tuple[str, str | None]]:
        groups = tuple(judged(r, share * 100 * i, 100 * i, **{c: n * i for c, n in d.items()})
                       for r, (share, d) in STRAGGLER_JOB.items())
        return [(f.finding, f.rank) for f in ev.evaluate({"stacks": stacks(*rows, groups=groups)}, now=5.0 * i).findings]

    waiting = RankStall("0", False, 3.0, "job", frames(*IN_ALL_REDUCE), suspected=True)
    assert tick(7, waiting) == [("straggler", "1")]
    frozen = RankStall("0", False, 30.0, "job", frames(*IN_ALL_REDUCE), suspected=True)
    assert tick(8, frozen) == []


def report(step: float, dataloader: float = 0.0, communication: float = 0.1) -> TraceReport:
    """A rank's trace; ``communication``: the share of its step in collectives."""
    return TraceReport(
        path=f"/t/{step}.json", rank=None, bytes=1, steps=(), steps_inferred=False, step_mean=step,
        step_max=step, breakdown={"dataloader": dataloader, "communication": communication,
                                  "cpu_exec": 1 - dataloader - communication}, gpu=None, devices=(),
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


def test_ranks_that_never_communicate_have_no_straggler_from_step_times() -> None:
    """Independent ranks (no collective in any rank's trace, as in the demo) wait for no
    one: a rank's steps twice as long as the other's name no straggler, as in `analyze`.
    One rank showing a collective is enough for the job to be judged."""
    def stragglers(comm0: float, comm1: float) -> list[str]:
        traces = TracesSnapshot("job", (RankTrace("0", report(0.040, communication=comm0), 1.0),
                                        RankTrace("1", report(0.100, communication=comm1), 1.0)), (), 0)
        return [f.rank for f in Evaluator(cfg()).evaluate({"traces": traces}, now=10.0).findings if f.finding == "straggler"]

    assert stragglers(0.0, 0.0) == []
    assert stragglers(0.0, 0.05) == ["1"]
    assert stragglers(0.1, 0.1) == ["1"]


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


def test_a_start_up_that_levelled_off_is_no_leak_and_a_leak_after_it_is() -> None:
    """A rank's RSS climbs for 100 s while it starts on a loaded node (torch imported, the
    model built), then holds: close to a line over the default 120 s of history and more
    (r2 above MIN_R2), yet never a leak. The same start-up followed by a steady leak is
    one, once the leak fills the history's later half."""
    startup = lambda t: GIB * min(t, 100) / 100  # noqa: E731
    defaults = cfg(leak_min_span_seconds=FindingsConfig().leak_min_span_seconds)
    ev = Evaluator(defaults)
    found = []
    for t in range(0, 305, 5):
        found += [(t, f.finding) for f in ev.evaluate({"host": host(startup(t), None, 0, 8 * GIB)}, now=float(t)).findings]
    assert line_r2(startup, 150) > 0.8 and found == []
    rate = 2 << 20
    ev = Evaluator(defaults)
    for t in range(0, 600, 5):
        snap = ev.evaluate({"host": host(startup(t) + rate * max(0, t - 100), None, 0, 8 * GIB)}, now=float(t))
        found += [(t, f.finding) for f in snap.findings]
    assert found and found[0][1] == "memory_leak" and 150 <= found[0][0] <= 400, found[:1]


def line_r2(value, until: int) -> float:
    series = MemorySeries(600.0)
    for t in range(0, until + 1, 5):
        series.add(float(t), value(t))
    fit = series.fit()
    assert fit is not None
    return fit[1]


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


def test_every_kind_has_its_section_in_diagnosis() -> None:
    """A kind of ``FindingKind`` without its ``##`` section in docs/diagnosis.md fails here, and
    so does a section heading that names a kind profagent does not have."""
    import re

    from helpers.paths import ROOT

    doc = (ROOT / "docs" / "diagnosis.md").read_text()
    headings = [line for line in doc.splitlines() if line.startswith("## ")]
    documented = {name for line in headings for name in re.findall(r"`([a-z_]+)`", line)}
    assert len(FINDING_KINDS) == len(set(FINDING_KINDS)) >= 12
    assert sorted(set(FINDING_KINDS) - documented) == []
    assert sorted(documented - set(FINDING_KINDS)) == []


def test_the_kinds_held_over_a_window_are_declared_by_their_modules() -> None:
    """steady.py holds what the modules declare (``WINDOW_HELD``), each a kind the module
    emits; the evaluator runs every module's analyzers, the arrival straggler first."""
    import ast
    import inspect

    from profagent.analysis.findings import evaluate, steps

    assert {"straggler", "dataloader_bound", "host_sync_bound", "optimizer_bound",
                                    "compile_storm"} == evaluate.WINDOW_HELD
    assert evaluate.ANALYZERS[0] is steps.analyze_arrival_straggler
    assert len(evaluate.ANALYZERS) == len(set(evaluate.ANALYZERS)) == 10
    for module in evaluate.MODULES:
        source = inspect.getsource(module)
        emitted = {node.args[0].value for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Finding"
                   and node.args and isinstance(node.args[0], ast.Constant)}
        literals = {node.value for node in ast.walk(ast.parse(source))
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)}
        assert emitted <= set(FINDING_KINDS), module
        assert literals & set(FINDING_KINDS) >= module.WINDOW_HELD, module  # held: a kind it names
        assert all(analyze.__module__ == module.__name__ for analyze in module.ANALYZERS)


def test_a_kind_not_declared_held_is_not_held() -> None:
    """gpu_throttled (declared by no module) clears at the first evaluation without it;
    a straggler (declared held) stays for the hold."""
    from profagent.analysis.findings.evaluate import WINDOW_HELD
    from profagent.analysis.findings.steady import Steady

    steady = Steady(hold_seconds=60.0, kinds=WINDOW_HELD)
    live = {("j", "0")}
    throttled = Finding("gpu_throttled", "j", "0", "info", "power cap")
    straggler = Finding("straggler", "j", "0", "warning", "slow")
    assert steady([throttled, straggler], 0.0, live) == [throttled, straggler]
    assert steady([], 10.0, live) == [straggler]


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


def test_straggler_from_trace_communication_share_when_step_times_are_equal() -> None:
    from dataclasses import replace

    def comm(share: float) -> TraceReport:
        return replace(report(0.0875), breakdown={"communication": share, "cpu_exec": 1 - share})

    # the issue's job: equal traced steps (synchronous), rank 2's communication share far below
    traces = TracesSnapshot("job", tuple(RankTrace(r, comm(c), 1.0) for r, c in
                                         (("0", 0.60), ("1", 0.61), ("2", 0.10), ("3", 0.62))), (), 0)
    [f] = Evaluator(cfg()).evaluate({"traces": traces}, now=10.0).findings
    assert (f.finding, f.rank, f.evidence["signal"]) == ("straggler", "2", "traces")
    assert f.evidence["others_median_communication_share"] == 0.61
    quiet = {"traces": traces, "stacks": stacks(RankStall("2", False, 6.0, "job", frames(*AT_LINE_68), suspected=True))}
    assert Evaluator(cfg()).evaluate(quiet, now=10.0).findings == ()


def test_two_processes_claiming_one_rank_are_a_duplicate_rank_finding() -> None:
    """Issue 51 high 3: two processes never claim one rank of a job without a finding
    saying so; a rank with one process (and the DataLoader workers' group) is no finding."""
    host = HostSnapshot(
        (GroupUsage("job", "0", "main", 2, Usage(rss=1)), GroupUsage("job", "1", "main", 1, Usage(rss=1)),
         GroupUsage("job", "1", "dataloader", 4, Usage(rss=1)), GroupUsage("job", "", "launcher", 1, Usage(rss=1))),
        NodeUsage(0.5, 16 * GIB, 8 * GIB, 8))
    snap = Evaluator(FindingsConfig()).evaluate({"host": host}, 1000.0)
    found = [f for f in snap.findings if f.finding == "duplicate_rank"]
    assert [(f.job_id, f.rank, f.severity, f.evidence["processes"]) for f in found] == [("job", "0", "warning", 2)]
    assert "2 processes claim rank 0 of job job" in found[0].summary

"""The stacks source's use of native windows (sources/stacks/source.py), driven with py-spy
results built from real --native output (tests/unit/fixtures/native) and an injected clock."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from profagent.analysis.collectives import in_collective, native_waits, python_only
from profagent.analysis.findings.hang import hang
from profagent.analysis.stacks import dominant_stack, parse_folded
from profagent.config import StacksConfig
from profagent.sources.stacks.sampler import Result
from profagent.sources.stacks.source import StacksSource
from profagent.sources.stacks.stall import STALE_GRACE

FIXTURES = Path(__file__).parent / "fixtures" / "native"
WINDOW = 2.0


class FakeSampler:
    def __init__(self) -> None:
        self.native: list[int] = []

    def request_native(self, pid: int) -> None:
        self.native.append(pid)


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def source(**cfg: float) -> tuple[StacksSource, FakeSampler, Clock]:
    clock = Clock()
    config = StacksConfig(window=WINDOW, stall_seconds=10.0, **cfg)  # type: ignore[arg-type]
    src = StacksSource(config, clock=clock, wall=clock)
    src._sampler = FakeSampler()  # type: ignore[assignment]
    return src, src._sampler, clock  # type: ignore[return-value]


def window(src: StacksSource, clock: Clock, pid: int, samples, native: bool = False) -> None:
    start = clock.t
    clock.t += WINDOW
    src._fold(Result("record", pid, "0", "main", start, clock.t, clock.t, samples=tuple(samples), native=native))


def fixture(name: str, pid: int) -> list:
    return parse_folded((FIXTURES / name).read_text(), pid)


def test_a_ddp_rank_blocked_in_backward_gets_one_native_look_then_stalls_as_a_victim() -> None:
    src, sampler, clock = source()
    native = fixture("ddp_reducer_record_native.raw", 12077)
    plain = [python_only(s) for s in native]
    window(src, clock, 12077, plain)
    assert sampler.native == [12077]  # the stack stood still for a whole window: look natively
    [stall] = src._snapshot("").stalls
    assert stall.suspected and stall.native_pending and not stall.stalled
    window(src, clock, 12077, native, native=True)
    for _ in range(5):
        window(src, clock, 12077, plain)
    [stall] = src._snapshot("").stalls
    assert stall.stalled and stall.unchanged_seconds > 10
    assert "c10d::Reducer::finalize_backward (libtorch_cpu.so)" in [f.name for f in stall.native]
    # looked again after half of stall_seconds (still pending here), not every window
    assert sampler.native == [12077, 12077] and stall.native_pending


def test_a_rank_computing_in_one_long_backward_is_not_stalled() -> None:
    src, sampler, clock = source()
    native = fixture("ddp_straggler_job_rank1.raw", 24265)
    top = max((python_only(s) for s in native if s.main), key=lambda s: s.count)
    # one long C++ call under one Python line: native frames move, the Python stack does not
    under_top = [s for s in native if s.main and python_only(s).folded == top.folded]
    window(src, clock, 24265, [top])
    assert sampler.native == [24265]
    window(src, clock, 24265, under_top, native=True)
    for _ in range(6):
        window(src, clock, 24265, [top])
    [stall] = src._snapshot("").stalls
    assert stall.unchanged_seconds > 10 and not stall.stalled and not stall.suspected


def test_a_rank_whose_python_stack_moves_in_its_native_windows_is_never_stalled() -> None:
    src, sampler, clock = source()
    native = fixture("ddp_straggler_job_rank1.raw", 24265)
    top = max((python_only(s) for s in native if s.main), key=lambda s: s.count)
    # under load a plain window may catch only backward's line; each native window asked for
    # (delivered next, as the sampler does) shows the other lines too
    for _ in range(12):
        asked = len(sampler.native)
        window(src, clock, 24265, [top])
        if len(sampler.native) > asked:
            window(src, clock, 24265, native, native=True)
        [stall] = src._snapshot("").stalls
        assert not stall.stalled, stall


def test_a_ddp_rank_that_blocks_during_a_periodic_native_window_waits_it_does_not_compute() -> None:
    """A periodic native window in which the rank stepped, then blocked in backward's reducer
    for most of it: its frames moved, but its most sampled stack is the collective. The rank
    is a victim in that collective from then on, not a rank computing in one long C++ call."""
    src, sampler, clock = source(native_every_seconds=10.0)
    stepping = [s for s in fixture("ddp_straggler_job_rank1.raw", 12077) if s.main]
    blocked = fixture("ddp_reducer_record_native.raw", 12077)
    plain = [python_only(s) for s in blocked]
    window(src, clock, 12077, [python_only(s) for s in stepping])
    window(src, clock, 12077, [*stepping[:3], *blocked], native=True)
    for _ in range(6):
        window(src, clock, 12077, plain)
    [stall] = src._snapshot("").stalls
    assert stall.stalled and stall.suspected
    assert "c10d::Reducer::finalize_backward (libtorch_cpu.so)" in [f.name for f in stall.native]


def test_a_ddp_rank_that_blocks_late_in_a_periodic_native_window_is_judged_from_its_next_look() -> None:
    """A periodic native window in which the rank computed for most of the window, then
    blocked in backward's reducer: its most sampled stack is backward's compute, from before
    the rank stopped. It is not where the rank stands: the rank is neither named a culprit
    stuck in backward beside the real one (CI saw that) nor a victim yet. Until its next
    native window (asked half of stall_seconds after that look) it may still be computing
    (a straggler's backward): it is not stalled, and the first verdict waits for that look."""
    src, sampler, clock = source(native_every_seconds=100.0)
    stepping = [s for s in fixture("ddp_straggler_job_rank1.raw", 12077) if s.main]
    blocked = fixture("ddp_reducer_record_native.raw", 12077)
    plain = [python_only(s) for s in blocked]
    window(src, clock, 12077, [python_only(s) for s in stepping])
    assert sampler.native == [12077]  # the first steady window: the periodic look
    late = [*stepping, dataclasses.replace(blocked[0], count=5)]  # blocked for the last few samples
    assert not in_collective(dominant_stack(late))  # stepping for most of the window
    window(src, clock, 12077, late, native=True)
    for _ in range(5):  # the stack stands still from here on
        window(src, clock, 12077, plain)
    assert sampler.native == [12077, 12077]  # looked at again after stall_seconds / 2
    [stall] = src._snapshot("").stalls
    assert stall.unchanged_seconds > 8 and not stall.stalled and stall.native == () and stall.native_pending
    culprit = dataclasses.replace(stall, rank="1", frames=stall.frames[:2], stalled=True, unchanged_seconds=12.0,
                                  native=(), native_pending=False)
    assert hang([stall, culprit], "") == []  # the first verdict waits for rank 0's look on its way
    settled = hang([stall, culprit], "", settled=True)  # (a verdict already given is not held back)
    assert [f.evidence["culprit_ranks"] for f in settled] == [["1"]], settled
    window(src, clock, 12077, blocked, native=True)  # the next look: it waits in the reducer
    [stall] = src._snapshot("").stalls
    assert stall.stalled and "c10d::Reducer::finalize_backward (libtorch_cpu.so)" in [f.name for f in stall.native]
    [finding] = hang([stall, culprit], "")
    assert finding.evidence["culprit_ranks"] == ["1"] and finding.evidence["waiting_ranks"] == ["0"], finding


def test_a_look_from_before_the_stack_stood_still_stands_for_it_stall_seconds_at_most() -> None:
    """A rank computing under one Python line, whose native windows stop coming back (py-spy
    cannot read them): its last look, from before its stack stood still, keeps it from being
    stalled for stall_seconds, not for ever."""
    src, sampler, clock = source(native_every_seconds=100.0)
    stepping = [s for s in fixture("ddp_straggler_job_rank1.raw", 12077) if s.main]
    plain = [python_only(s) for s in fixture("ddp_reducer_record_native.raw", 12077)]
    window(src, clock, 12077, [python_only(s) for s in stepping])
    window(src, clock, 12077, [*stepping], native=True)
    for _ in range(4):
        window(src, clock, 12077, plain)
    [stall] = src._snapshot("").stalls
    assert not stall.stalled and not stall.suspected  # 8 s after the look: may be computing
    for _ in range(3):
        window(src, clock, 12077, plain)
    [stall] = src._snapshot("").stalls
    assert stall.stalled and stall.unchanged_seconds > 12 and stall.native == ()


def test_waits_are_judged_from_the_first_steady_native_window_on() -> None:
    src, sampler, clock = source(native_every_seconds=100.0)
    native = fixture("ddp_straggler_job_rank0.raw", 24264)
    plain = [python_only(s) for s in native]
    window(src, clock, 24264, plain)
    [group] = src._snapshot("").groups
    assert group.judged == 0 and sampler.native == [24264]  # steady: periodic native asked for
    window(src, clock, 24264, native, native=True)
    window(src, clock, 24264, plain)
    [group] = src._snapshot("").groups
    main = sum(s.count for s in plain if s.main)
    share = native_waits([s for s in native if s.main]) / main
    assert group.judged == 2 * main and share > 0.8
    # the native window counts its waits; the plain one the same share, learned from it
    assert abs(group.collective_wait / group.judged - share) < 1e-9, group
    assert sampler.native == [24264]  # the next periodic one after native_every_seconds


def test_a_native_window_that_caught_start_up_is_asked_again_at_the_next_steady_window() -> None:
    """A rank still importing during its first native window (a lazy import in its first
    steps) is not judged from it; waiting native_every_seconds for the next would leave the
    rank without a collective-wait share, and out of the straggler rule, that long."""
    src, sampler, clock = source(native_every_seconds=300.0)
    native = fixture("ddp_straggler_job_rank0.raw", 24264)
    plain = [python_only(s) for s in native]
    importing = parse_folded("thread (24264): MainThread;<module> (plain_ddp.py:103);"
                             "_find_and_load (<frozen importlib._bootstrap>:1176) 40\n", 24264)
    window(src, clock, 24264, plain)
    assert sampler.native == [24264]
    window(src, clock, 24264, [*native, *importing], native=True)  # caught an import: not learned
    [group] = src._snapshot("").groups
    assert group.judged == 0
    window(src, clock, 24264, plain)  # steady again: asked again at once, not in 300 s
    assert sampler.native == [24264, 24264]
    window(src, clock, 24264, native, native=True)
    [group] = src._snapshot("").groups
    assert group.judged == sum(s.count for s in native if s.main)
    window(src, clock, 24264, plain)
    assert sampler.native == [24264, 24264]  # learned: the next periodic one in 300 s


def test_a_native_window_asked_of_a_process_that_is_no_longer_the_rank_is_asked_again() -> None:
    # torchrun's launcher looks like rank 0 until it starts the ranks: it got the first request
    src, sampler, clock = source(native_every_seconds=100.0)
    plain = [python_only(s) for s in fixture("ddp_straggler_job_rank0.raw", 24264)]
    window(src, clock, 111, plain)
    assert sampler.native == [111]
    window(src, clock, 24264, plain)  # the real rank 0
    assert sampler.native == [111, 24264]


def test_a_rank_whose_backward_stands_still_every_step_gets_one_native_look_per_half_stall() -> None:
    """Long steps: each backward stands still for whole windows. A look from an earlier step
    (not the one that saw the stack begin to stand) brings no new native window before half
    of stall_seconds: a native window pauses the rank at each sample."""
    src, sampler, clock = source()
    native = fixture("ddp_straggler_job_rank1.raw", 24265)
    top = max((python_only(s) for s in native if s.main), key=lambda s: s.count)
    under_top = [s for s in native if s.main and python_only(s).folded == top.folded]
    other = [python_only(s) for s in native if s.main and python_only(s).folded != top.folded]
    window(src, clock, 24265, [top])
    window(src, clock, 24265, under_top, native=True)  # the look, within this step's run
    assert sampler.native == [24265]
    window(src, clock, 24265, other)  # the next step: optimizer and forward, the stack moves
    window(src, clock, 24265, [top])  # backward stands still again, 4 s after the look
    assert sampler.native == [24265]
    window(src, clock, 24265, other)
    window(src, clock, 24265, [top])  # 8 s after the look, past stall_seconds / 2: look again
    assert sampler.native == [24265, 24265]


def _samples(pid: int, *stacks: tuple[str, int]) -> list:
    return parse_folded("\n".join(f"thread ({pid}): MainThread;{stack} {n}" for stack, n in stacks), pid)


def test_a_rank_read_from_before_the_others_stalled_holds_the_hang_verdict_until_read_again() -> None:
    """Run 41 of the fresh-clone chain: rank 1 stopped at its line during a 20 s steady window
    begun before; rank 0 stalled in the reducer meanwhile. The verdict read rank 1 from the
    window before, in backward, and said every rank waits. It now waits for rank 1's next
    window, read at the full rate as soon as a stall is suspected in its job."""
    src, sampler, clock = source(native=False, steady_rate=4, steady_window=20.0, warmup_seconds=0.0)
    forward = "<module> (train.py:80);main (train.py:70);Net.forward (train.py:30)"
    waiting = ("<module> (train.py:80);main (train.py:70);wrapper (torch/distributed/c10d_logger.py:81);"
               "all_reduce (torch/distributed/distributed_c10d.py:3252)")
    sleeping = "<module> (train.py:80);main (train.py:68);sleep (<built-in>)"
    wanted = {100: ("0", "main"), 101: ("1", "main")}
    assert src._pace(wanted) == {100: (4, 20.0), 101: (4, 20.0)}  # steady
    src._fold(Result("record", 101, "1", "main", 0.0, 20.0, 20.0,
                     samples=tuple(_samples(101, (forward, 50), (waiting, 30)))))
    for start in range(2, 20, 2):  # rank 0 stands in the collective from t=2 on
        clock.t = start + WINDOW
        src._fold(Result("record", 100, "0", "main", start, clock.t, clock.t,
                         samples=tuple(_samples(100, (waiting, 100)))))
        if start == 2:  # suspected after one window: every rank of the job at the full rate
            assert src._pace(wanted) == {100: (20, 2.0), 101: (20, 2.0)}
    zero, one = src._snapshot("").stalls
    assert zero.stalled and not one.stalled and one.stale
    assert hang([zero, one], "") == []  # not "every rank waits"
    assert hang([zero, one], "", settled=True) != []  # a verdict out is never taken back
    src._fold(Result("record", 101, "1", "main", 20.0, 22.0, 22.0, samples=tuple(_samples(101, (sleeping, 40)))))
    clock.t = 22.0
    zero, one = src._snapshot("").stalls
    assert not one.stale
    [f] = hang([zero, one], "")
    assert f.rank == "1" and f.evidence["diagnosis"] == "culprit" and f.evidence["waiting_ranks"] == ["0"]


def test_a_rank_never_read_again_is_judged_from_its_last_window_after_a_grace() -> None:
    src, _, clock = source(native=False, steady_rate=4, steady_window=20.0)
    waiting = "<module> (train.py:80);main (train.py:70);all_reduce (torch/distributed/distributed_c10d.py:3252)"
    forward = "<module> (train.py:80);main (train.py:70);Net.forward (train.py:30)"
    src._fold(Result("record", 101, "1", "main", 0.0, 20.0, 20.0,
                     samples=tuple(_samples(101, (waiting, 30), (forward, 50)))))
    for start in range(2, 60, 2):
        clock.t = start + WINDOW
        src._fold(Result("record", 100, "0", "main", start, clock.t, clock.t,
                         samples=tuple(_samples(100, (waiting, 100)))))
        one = src._snapshot("").stalls[1]
        # stale while a window begun before the stall may still come back (py-spy failing on it)
        assert one.stale == (zero_stalled(src) and clock.t - 20.0 < 20.0 + STALE_GRACE), clock.t
    [f] = hang(src._snapshot("").stalls, "")
    assert f.rank == "1" and f.evidence["diagnosis"] == "culprit"  # its last window: mostly forward


def zero_stalled(src: StacksSource) -> bool:
    return src._snapshot("").stalls[0].stalled

"""The stacks source's use of native windows (sources/stacks/source.py), driven with py-spy
results built from real --native output (tests/unit/fixtures/native) and an injected clock."""

from __future__ import annotations

from pathlib import Path

from profagent.analysis.collectives import native_waits, python_only
from profagent.analysis.stacks import parse_folded
from profagent.config import StacksConfig
from profagent.sources.stacks.sampler import Result
from profagent.sources.stacks.source import StacksSource

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
    window(src, clock, 24265, [top])  # under load a plain window may catch only backward's line
    window(src, clock, 24265, native, native=True)
    for _ in range(6):
        window(src, clock, 24265, [top])
    [stall] = src._snapshot("").stalls
    assert stall.unchanged_seconds > 10 and not stall.stalled and not stall.suspected


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


def test_a_native_window_asked_of_a_process_that_is_no_longer_the_rank_is_asked_again() -> None:
    # torchrun's launcher looks like rank 0 until it starts the ranks: it got the first request
    src, sampler, clock = source(native_every_seconds=100.0)
    plain = [python_only(s) for s in fixture("ddp_straggler_job_rank0.raw", 24264)]
    window(src, clock, 111, plain)
    assert sampler.native == [111]
    window(src, clock, 24264, plain)  # the real rank 0
    assert sampler.native == [111, 24264]

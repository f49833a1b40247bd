"""The stacks source's pieces on their own: the ring of recent folded stacks (/api/stacks)
and the pace policy (how fast each process is looked at)."""

from __future__ import annotations

from profagent.analysis.stacks import Sample
from profagent.config import StacksConfig
from profagent.sources.stacks.pace import WATCH_HOLD, PacePolicy
from profagent.sources.stacks.ring import RING_MAX_BYTES, RING_MAX_LINES, StackRing


def sample(folded: str, count: int) -> Sample:
    return Sample("MainThread", True, (), count, folded)


def test_the_ring_sums_windows_within_the_horizon_per_rank_and_job() -> None:
    ring = StackRing()
    ring.add(("a", "0"), 100.0, [sample("main;f", 3), sample("main;g", 1)], keep_seconds=60)
    ring.add(("a", "0"), 110.0, [sample("main;f", 2)], keep_seconds=60)
    ring.add(("b", "0"), 110.0, [sample("main;h", 5)], keep_seconds=60)
    ring.add(("a", "1"), 110.0, [sample("w", 1)], keep_seconds=60, prefix="dataloader worker;")
    assert ring.ranks() == [("a", "0"), ("a", "1"), ("b", "0")]
    assert ring.folded("0", since=0.0, job_id="a") == "main;f 5\nmain;g 1\n"
    assert ring.folded("0", since=105.0, job_id="a") == "main;f 2\n"  # the first window ended before
    assert ring.folded("0", since=0.0) == "main;f 5\nmain;g 1\nmain;h 5\n"  # both jobs
    assert ring.folded("1", since=0.0) == "dataloader worker;w 1\n"
    ring.add(("a", "0"), 200.0, [sample("main;k", 1)], keep_seconds=60)  # 100 and 110 are now too old
    assert ring.folded("0", since=0.0, job_id="a") == "main;k 1\n"
    ring.forget({"b"})
    assert ring.ranks() == [("b", "0")]


def test_the_ring_is_bounded_in_lines_per_window_and_bytes_per_rank() -> None:
    ring = StackRing()
    ring.add(("a", "0"), 1.0, [sample(f"f{i}", 1) for i in range(RING_MAX_LINES + 10)], keep_seconds=3600)
    assert len(ring.folded("0", since=0.0).splitlines()) == RING_MAX_LINES
    line = "x" * 10_000
    for t in range(2, 1000):  # ~10 kB a window: the byte cap, not the horizon, drops the oldest
        ring.add(("a", "0"), float(t), [sample(f"{line}{t}", 1)], keep_seconds=3600)
    assert 0 < ring.bytes(("a", "0")) <= RING_MAX_BYTES
    kept = ring.folded("0", since=0.0).splitlines()
    assert kept[-1].endswith("999 1") and len(kept) == RING_MAX_BYTES // (len(line) + 3 + 8)


def test_pace_full_while_warming_suspected_hot_or_watched_else_steady() -> None:
    cfg = StacksConfig(rate=20, window=5, steady_rate=4, steady_window=20, warmup_seconds=60)
    full, steady = (20, 5.0), (4, 20.0)
    policy = PacePolicy()
    job = {1: "a", 2: "a", 3: "b"}.__getitem__
    hot: set[str] = set()
    assert policy.pace(cfg, [1, 2, 3], job, set(), hot.__contains__, 0.0) == {1: full, 2: full, 3: full}
    assert policy.pace(cfg, [1, 2, 3], job, set(), hot.__contains__, 60.0) == {1: steady, 2: steady, 3: steady}
    assert policy.pace(cfg, [1, 2, 3], job, {"a"}, hot.__contains__, 60.0) == {1: full, 2: full, 3: steady}
    hot.add("b")
    assert policy.pace(cfg, [1, 2, 3], job, set(), hot.__contains__, 60.0) == {1: steady, 2: steady, 3: full}
    hot.clear()
    policy.watched(100.0)
    assert set(policy.pace(cfg, [1, 2, 3], job, set(), hot.__contains__, 100.0 + WATCH_HOLD - 0.1).values()) == {full}
    assert set(policy.pace(cfg, [1, 2, 3], job, set(), hot.__contains__, 100.0 + WATCH_HOLD).values()) == {steady}
    # a process first seen now warms up; one that left and came back is new again
    assert policy.pace(cfg, [1, 4], job.__self__.get, set(), hot.__contains__, 200.0) == {1: steady, 4: full}
    assert policy.pace(cfg, [4], job.__self__.get, set(), hot.__contains__, 201.0) == {4: full}
    assert policy.pace(cfg, [1], job, set(), hot.__contains__, 300.0) == {1: full}  # forgotten at 201, new at 300
    no_steady = StacksConfig(rate=20, window=5, steady_rate=0)
    assert policy.pace(no_steady, [1, 2], job, set(), hot.__contains__, 10_000.0) == {1: full, 2: full}

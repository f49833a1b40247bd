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


def _stack(*frames: str) -> Sample:
    from profagent.analysis.stacks import parse_frame

    parsed = tuple(parse_frame(f) for f in frames)
    return Sample("MainThread", True, parsed, 10, ";".join(frames))


def test_the_stall_policy_follows_a_rank_that_stands_still_and_its_dataloader_workers() -> None:
    """A rank whose one stack lasts past stall_seconds is stalled; waiting for its DataLoader,
    its workers are sampled, and one that stands still making a batch holds the rank up."""
    from profagent.contracts import ROLE_DATALOADER, ROLE_MAIN, ProcessInfo
    from profagent.sources.stacks.stall import StallPolicy

    cfg = StacksConfig(stall_seconds=10, window=5, steady_rate=0)
    policy = StallPolicy()
    wait = _stack("train (train.py:9)", "_BaseDataLoaderIter.__next__ (torch/utils/data/dataloader.py:725)",
                  "_MultiProcessingDataLoaderIter._get_data (torch/utils/data/dataloader.py:1460)")
    busy = _stack("train (train.py:9)", "step (train.py:20)")
    processes = [ProcessInfo(100, 1, 0.0, ROLE_MAIN, "0", "0", "2", "python", "j"),
                 ProcessInfo(101, 100, 0.0, ROLE_DATALOADER, "0", "0", "2", "python", "j"),
                 ProcessInfo(200, 1, 0.0, ROLE_MAIN, "1", "1", "2", "python", "j")]
    moving = [busy, _stack("train (train.py:9)", "other (train.py:30)")]  # two stacks in a window: it moves
    policy.check_rank(("j", "1"), moving, 0.0, 5.0, None, cfg.stall_seconds)
    policy.check_rank(("j", "0"), moving, 0.0, 5.0, None, cfg.stall_seconds)
    assert policy.workers_to_sample(processes) == {} and policy.suspects() == set()
    for start in (5.0, 10.0, 15.0):  # rank 0 stands still from 5 s on
        policy.check_rank(("j", "0"), [wait], start, start + 5.0, None, cfg.stall_seconds)
    assert policy.suspects() == {"j"}
    assert policy.workers_to_sample(processes) == {101: ("0", ROLE_DATALOADER)}  # rank 0 waits for its DataLoader
    [zero, one] = policy.rank_stalls(cfg, {}, set(), 20.0)
    assert (zero.rank, zero.stalled, zero.unchanged_seconds, zero.workers_pending) == ("0", True, 15.0, True)
    # rank 1's last window (0-5 s) began before rank 0 stood still, and ended 15 s ago, within
    # the longest window (5 s) + STALE_GRACE: it is shown as stale, not as moving
    assert (one.rank, one.stalled, one.stale) == ("1", False, True)
    making = _stack("_worker_loop (torch/utils/data/_utils/worker.py:300)",
                    "fetch (torch/utils/data/_utils/fetch.py:52)", "__getitem__ (data.py:7)")
    for start in (20.0, 25.0, 30.0, 35.0):
        policy.check_worker(("j", "0"), 101, [making], start, start + 5.0, cfg.stall_seconds)
    [zero, _] = policy.rank_stalls(cfg, {}, set(), 40.0)
    [worker] = zero.workers
    assert (worker.pid, worker.stuck, worker.unchanged_seconds, zero.workers_pending) == (101, True, 20.0, False)
    policy.forget({"other"})
    assert policy.rank_stalls(cfg, {}, set(), 40.0) == () and policy.suspects() == set()

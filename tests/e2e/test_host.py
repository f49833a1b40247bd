"""Host source: aggregation per (rank, role) and counters that survive worker churn."""

from __future__ import annotations

import dataclasses

import psutil

from profagent.contracts import ProcessInfo, ProcessTree, Usage
from profagent.sources.host import USS_EVERY, USS_PER_TICK, HostSource


def _info(pid: int, role: str, rank: str = "0") -> ProcessInfo:
    return ProcessInfo(pid, 1, float(pid), role, rank, rank, "1", f"p{pid}", job_id="j")


class FakeProcess:
    def __init__(self, pid: int) -> None:
        self.pid = pid


class FakeReader:
    """Readings per PID, set by the test (psutil.Process objects are never queried)."""

    def __init__(self) -> None:
        self.values: dict[int, Usage] = {}

    def __call__(self, proc: psutil.Process) -> Usage:
        if proc.pid not in self.values:
            raise psutil.NoSuchProcess(proc.pid)
        return self.values[proc.pid]


def _source(reader: FakeReader) -> HostSource:
    return HostSource(reader=reader, process_factory=FakeProcess, uss_reader=lambda proc: None)


def _group(snap, rank, role):
    return next(g for g in snap.groups if (g.rank, g.role) == (rank, role))


def test_workers_aggregate_into_their_rank_and_counters_survive_churn() -> None:
    reader = FakeReader()
    src = _source(reader)
    reader.values = {
        10: Usage(cpu_user=5.0, rss=100, threads=4, ctx_voluntary=7),
        11: Usage(cpu_user=1.0, rss=10, threads=1, ctx_voluntary=2),
        12: Usage(cpu_user=2.0, rss=20, threads=1, ctx_voluntary=3),
    }
    tree = ProcessTree("j", 10, (_info(10, "main"), _info(11, "dataloader"), _info(12, "dataloader")), True)
    snap = src.collect(tree)
    dl = _group(snap, "0", "dataloader")
    assert (dl.processes, dl.usage.cpu_user, dl.usage.rss, dl.usage.ctx_voluntary) == (2, 3.0, 30, 5)

    # Worker 11 exits, a new worker 13 starts (an epoch boundary).
    reader.values = {
        10: Usage(cpu_user=6.0, rss=100, threads=4, ctx_voluntary=8),
        12: Usage(cpu_user=2.5, rss=20, threads=1, ctx_voluntary=3),
        13: Usage(cpu_user=0.1, rss=15, threads=1, ctx_voluntary=1),
    }
    tree = dataclasses.replace(tree, processes=(_info(10, "main"), _info(12, "dataloader"), _info(13, "dataloader")))
    snap2 = src.collect(tree)
    dl2 = _group(snap2, "0", "dataloader")
    assert dl2.processes == 2
    assert dl2.usage.cpu_user == 1.0 + 2.5 + 0.1  # the exited worker's CPU is kept
    assert dl2.usage.ctx_voluntary == 2 + 3 + 1
    assert dl2.usage.rss == 35  # gauges only count live processes
    assert _group(snap2, "0", "main").usage.cpu_user == 6.0

    # All workers gone: the group stays, counters keep their value, gauges drop to 0.
    reader.values = {10: Usage(cpu_user=7.0, rss=100, threads=4)}
    snap3 = src.collect(dataclasses.replace(tree, processes=(_info(10, "main"),)))
    dl3 = _group(snap3, "0", "dataloader")
    assert dl3.processes == 0 and dl3.usage.rss == 0
    assert dl3.usage.cpu_user == 1.0 + 2.5 + 0.1


def test_unreadable_fields_stay_absent() -> None:
    reader = FakeReader()
    reader.values = {10: Usage(cpu_user=1.0, fds=None, read_bytes=None, write_bytes=None)}
    snap = _source(reader).collect(ProcessTree("j", 10, (_info(10, "main"),), True))
    usage = _group(snap, "0", "main").usage
    assert usage.fds is None and usage.read_bytes is None


def test_real_process_readings() -> None:
    import os

    src = HostSource()
    src.start()
    me = psutil.Process()
    tree = ProcessTree("j", os.getpid(), (ProcessInfo(me.pid, me.ppid(), me.create_time(), "main", "0", "0", "1", "pytest", "j"),), True)
    snap = src.collect(tree)
    usage = _group(snap, "0", "main").usage
    assert usage.rss > 10_000_000 and usage.threads >= 1 and usage.cpu_user > 0
    assert usage.fds is not None and usage.fds > 2
    assert 0 < snap.node.memory_available <= snap.node.memory_total


def test_dataloader_workers_get_uss_without_shared_pages() -> None:
    """A forked worker shares the parent's pages: its USS is well below its RSS."""
    import os
    import subprocess
    import sys

    # The parent touches 200 MB, then forks a child that only reads them (shared, copy-on-write).
    code = ("import os,time,sys\nb=bytearray(200<<20)\nfor i in range(0,len(b),4096): b[i]=1\n"
            "pid=os.fork()\nif pid==0:\n  s=sum(b[::4096]); print('ready',flush=True); time.sleep(60)\n"
            "else:\n  os.waitpid(pid,0)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        child = psutil.Process(parent.pid).children()[0]
        tree = ProcessTree("j", parent.pid, (
            ProcessInfo(parent.pid, os.getpid(), psutil.Process(parent.pid).create_time(), "main", "0", "0", "1", "p", "j"),
            ProcessInfo(child.pid, parent.pid, child.create_time(), "dataloader", "0", "0", "1", "w", "j"),
        ), True)
        src = HostSource()
        src.start()
        snap = src.collect(tree)
        worker = _group(snap, "0", "dataloader").usage
        assert worker.rss > 150 << 20, worker.rss
        assert worker.uss is not None and worker.uss < 50 << 20, worker.uss
        assert _group(snap, "0", "main").usage.uss is None  # only workers pay for reading smaps
    finally:
        for p in psutil.Process(parent.pid).children():
            p.kill()
        parent.kill()
        parent.wait()


def test_worker_uss_is_read_every_uss_every_seconds_not_every_tick() -> None:
    reader = FakeReader()
    reads: list[int] = []
    now = [0.0]

    def uss(proc) -> int:
        reads.append(proc.pid)
        return 1000 + len(reads)

    src = HostSource(reader=reader, process_factory=FakeProcess, uss_reader=uss, clock=lambda: now[0])
    reader.values = {10: Usage(rss=100), 11: Usage(rss=10)}
    tree = ProcessTree("j", 10, (_info(10, "main"), _info(11, "dataloader")), True)
    first = _group(src.collect(tree), "0", "dataloader").usage.uss
    now[0] = USS_EVERY - 0.1
    assert _group(src.collect(tree), "0", "dataloader").usage.uss == first  # cached
    assert reads == [11]  # only the worker pays for smaps, once
    now[0] = USS_EVERY
    assert _group(src.collect(tree), "0", "dataloader").usage.uss == first + 1  # read again
    # A worker that exits takes its cached USS with it; a new one is read at once.
    reader.values = {10: Usage(rss=100), 12: Usage(rss=10)}
    tree = ProcessTree("j", 10, (_info(10, "main"), _info(12, "dataloader")), True)
    src.collect(tree)
    assert reads == [11, 11, 12]


def test_uss_is_read_at_once_for_new_workers_then_at_most_uss_per_tick_rereads_a_tick() -> None:
    """smaps_rollup costs ms of kernel time per worker: re-reads are spread over ticks, the
    least recently read first; a new worker is read at once (its group's sum never ramps)."""
    reader = FakeReader()
    reads: list[int] = []
    now = [0.0]

    def uss(proc) -> int:
        reads.append(proc.pid)
        return 100

    src = HostSource(reader=reader, process_factory=FakeProcess, uss_reader=uss, clock=lambda: now[0])
    workers = list(range(11, 11 + 2 * USS_PER_TICK + 1))
    reader.values = {10: Usage(rss=100), **{w: Usage(rss=10) for w in workers}}
    tree = ProcessTree("j", 10, (_info(10, "main"), *(_info(w, "dataloader") for w in workers)), True)
    assert _group(src.collect(tree), "0", "dataloader").usage.uss == 100 * len(workers)
    assert sorted(reads) == workers  # all new: all read
    reads.clear()
    now[0] = USS_EVERY - 0.1
    src.collect(tree)
    assert reads == []  # cached
    stale_reads: list[list[int]] = []
    for tick in range(3):
        now[0] = USS_EVERY + tick
        before = len(reads)
        snap = src.collect(tree)
        stale_reads.append(reads[before:])
        assert _group(snap, "0", "dataloader").usage.uss == 100 * len(workers)  # cached ones in the sum
    assert [len(r) for r in stale_reads] == [USS_PER_TICK, USS_PER_TICK, 1]
    assert sorted(reads) == workers  # each re-read once
    reader.values[99] = Usage(rss=10)
    tree = ProcessTree("j", 10, (*tree.processes, _info(99, "dataloader")), True)
    reads.clear()
    src.collect(tree)
    assert reads == [99]  # a new worker is read at once, whatever the budget

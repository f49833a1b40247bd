"""Host source: CPU, memory, threads, fds, IO and context switches per rank and role.

Each process is read straight from /proc (``procfs.read_process_stats``: four small reads);
psutil is used for the node's figures and a DataLoader worker's USS.

Processes are aggregated by (rank, role), so DataLoader worker churn doesn't churn
series. Counters stay monotonic across churn: when a process exits, its last values
move into a "retired" total for its group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import psutil

from profagent.contracts import (
    ROLE_DATALOADER,
    GroupUsage,
    HostSnapshot,
    NodeUsage,
    ProcessInfo,
    ProcessTree,
    Usage,
)
from profagent.system.procfs import PROC, read_process_stats

Group = tuple[str, str, str]  # (job_id, rank, role)
# A worker's USS walks its page tables (/proc/PID/smaps_rollup: 1-3 ms of kernel time for a
# process that mapped torch, half the host collector's CPU at 8 ranks when read every 10 s):
# read it when a worker appears (a group's sum never ramps up as its workers are read), then
# this often, at most USS_PER_TICK re-reads per tick, the least recently read first. A leak
# grows over minutes; its alert judges after a 2-minute span.
USS_EVERY = 30.0
USS_PER_TICK = 2

COUNTER_FIELDS = (
    "cpu_user",
    "cpu_system",
    "cpu_iowait",
    "read_bytes",
    "write_bytes",
    "ctx_voluntary",
    "ctx_involuntary",
    "run_queue",
)



USAGE_FIELDS = tuple(f.name for f in fields(Usage))  # once: fields() per call was a tenth of a tick


def _add(a: Usage, b: Usage) -> Usage:
    values = {}
    for name in USAGE_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        values[name] = None if x is None and y is None else (x or 0) + (y or 0)
    return Usage(**values)



@dataclass(frozen=True)
class ProcHandle:
    """A process to read: its PID under a /proc root."""

    pid: int
    proc_root: Path = PROC


def read_usage(proc: ProcHandle) -> Usage:
    """Read one process. Raises OSError (FileNotFoundError...) if it exited meanwhile."""
    st = read_process_stats(proc.proc_root, proc.pid)
    return Usage(
        cpu_user=st.cpu_user,
        cpu_system=st.cpu_system,
        cpu_iowait=st.cpu_iowait,
        rss=st.rss,
        threads=st.threads,
        fds=st.fds,
        read_bytes=st.read_bytes,
        write_bytes=st.write_bytes,
        ctx_voluntary=st.ctx_voluntary,
        ctx_involuntary=st.ctx_involuntary,
        run_queue=st.run_queue,
    )


def read_uss(proc: ProcHandle) -> int | None:
    """Unique set size (psutil reads /proc/PID/smaps_rollup: ms of kernel time, so
    DataLoader workers only). None where the platform or permissions don't allow it."""
    try:
        return getattr(psutil.Process(proc.pid).memory_full_info(), "uss", None)
    except psutil.AccessDenied:
        return None


class HostSource:
    name = "host"

    def __init__(
        self,
        interval: float = 1.0,
        reader: Callable[[ProcHandle], Usage] = read_usage,
        process_factory: Callable[[int], ProcHandle] = ProcHandle,
        uss_reader: Callable[[ProcHandle], int | None] = read_uss,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``reader``, ``uss_reader`` and ``process_factory`` are injectable so tests can feed readings."""
        self.interval = interval
        self._read = reader
        self._read_uss = uss_reader
        self._new_process = process_factory
        self._clock = clock
        self._uss: dict[tuple[int, float], tuple[float, int | None]] = {}  # key -> (read at, USS)
        self._procs: dict[tuple[int, float], ProcHandle] = {}
        self._last: dict[tuple[int, float], tuple[Group, Usage]] = {}
        self._retired: dict[Group, Usage] = {}

    def start(self) -> None:
        psutil.cpu_percent(None)  # prime: the first call has no interval to measure

    def stop(self) -> None:
        self._procs.clear()

    def _process(self, info: ProcessInfo) -> ProcHandle:
        key = (info.pid, info.create_time)
        proc = self._procs.get(key)
        if proc is None:
            proc = self._procs[key] = self._new_process(info.pid)
        return proc

    def _uss_due(self, workers: list[tuple[int, float]]) -> set[tuple[int, float]]:
        """The workers whose USS is read this tick: every one never read, and of those
        read USS_EVERY ago or more, USS_PER_TICK, the least recently read first."""
        now = self._clock()
        stale = sorted((self._uss[key][0], key) for key in workers
                       if key in self._uss and now - self._uss[key][0] >= USS_EVERY)
        return {key for key in workers if key not in self._uss} | {key for _, key in stale[:USS_PER_TICK]}

    def _worker_uss(self, key: tuple[int, float], proc: ProcHandle, due: set[tuple[int, float]]) -> int | None:
        if key in due:
            self._uss[key] = (self._clock(), self._read_uss(proc))
        cached = self._uss.get(key)
        return None if cached is None else cached[1]

    def collect(self, tree: ProcessTree) -> HostSnapshot:
        current: dict[tuple[int, float], tuple[Group, Usage]] = {}
        counts: dict[Group, int] = {}
        # Jobs still listed (watch mode keeps an ended job for its grace period) keep
        # their retired counters; a job no longer listed takes its groups with it.
        live_jobs = {p.job_id for p in tree.processes} | set(tree.job_status())
        uss_due = self._uss_due([(p.pid, p.create_time) for p in tree.processes if p.role == ROLE_DATALOADER])
        for info in tree.processes:
            key = (info.pid, info.create_time)
            group = (info.job_id, info.rank, info.role)
            try:
                proc = self._process(info)
                usage = self._read(proc)
                if info.role == ROLE_DATALOADER and usage.uss is None:
                    usage = replace(usage, uss=self._worker_uss(key, proc, uss_due))
            except (OSError, psutil.Error):
                continue  # exited between the tree refresh and now: retired below
            current[key] = (group, usage)
            counts[group] = counts.get(group, 0) + 1

        # Processes that left keep contributing their last counters to their group.
        for key, (group, usage) in self._last.items():
            if key not in current:
                counter_part = Usage(**{f: getattr(usage, f) for f in COUNTER_FIELDS})
                self._retired[group] = _add(self._retired.get(group, Usage()), counter_part)
                self._procs.pop(key, None)
                self._uss.pop(key, None)
        self._last = current
        self._retired = {g: u for g, u in self._retired.items()
                         if g[0] in live_jobs and (g[0], g[1]) not in tree.expired_ranks}

        totals: dict[Group, Usage] = dict(self._retired)
        for group, usage in current.values():
            totals[group] = _add(totals.get(group, Usage()), usage)
        groups = tuple(
            GroupUsage(job_id, rank, role, counts.get((job_id, rank, role), 0), usage)
            for (job_id, rank, role), usage in sorted(totals.items())
        )
        vm = psutil.virtual_memory()
        node = NodeUsage(
            cpu_ratio=psutil.cpu_percent(None) / 100.0,
            memory_total=vm.total,
            memory_available=vm.available,
            cpu_count=psutil.cpu_count() or 1,
        )
        return HostSnapshot(groups, node)

"""Host source (psutil): CPU, memory, threads, fds, IO and context switches per rank and role.

Processes are aggregated by (rank, role), so DataLoader worker churn doesn't churn
series. Counters stay monotonic across churn: when a process exits, its last values
move into a "retired" total for its group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import psutil

from profagent.target import ROLE_DATALOADER, ProcessInfo, ProcessTree

Group = tuple[str, str, str]  # (job_id, rank, role)
# A worker's USS walks its smaps (1-3 ms for a process that mapped torch): read it this
# often, not every tick. A leak grows over minutes; its alert reads a 2-minute floor.
USS_EVERY = 10.0

COUNTER_FIELDS = (
    "cpu_user",
    "cpu_system",
    "cpu_iowait",
    "read_bytes",
    "write_bytes",
    "ctx_voluntary",
    "ctx_involuntary",
)


@dataclass(frozen=True)
class Usage:
    """One process' (or one group's) readings. None = not readable here (absent, never 0)."""

    cpu_user: float = 0.0
    cpu_system: float = 0.0
    cpu_iowait: float | None = None
    rss: int = 0
    uss: int | None = None  # DataLoader workers only: memory unique to the process (no shared pages)
    threads: int = 0
    fds: int | None = None
    read_bytes: int | None = None
    write_bytes: int | None = None
    ctx_voluntary: int = 0
    ctx_involuntary: int = 0


def _add(a: Usage, b: Usage) -> Usage:
    values = {}
    for f in fields(Usage):
        x, y = getattr(a, f.name), getattr(b, f.name)
        values[f.name] = None if x is None and y is None else (x or 0) + (y or 0)
    return Usage(**values)


@dataclass(frozen=True)
class GroupUsage:
    job_id: str
    rank: str
    role: str
    processes: int
    usage: Usage


@dataclass(frozen=True)
class NodeUsage:
    cpu_ratio: float
    memory_total: int
    memory_available: int
    cpu_count: int


@dataclass(frozen=True)
class HostSnapshot:
    groups: tuple[GroupUsage, ...]
    node: NodeUsage


def read_usage(proc: psutil.Process) -> Usage:
    """Read one process. Raises psutil.NoSuchProcess if it exited meanwhile."""
    with proc.oneshot():
        cpu = proc.cpu_times()
        mem = proc.memory_info()
        ctx = proc.num_ctx_switches()
        threads = proc.num_threads()
        try:
            fds: int | None = proc.num_fds()
        except psutil.AccessDenied:
            fds = None
        try:
            io = proc.io_counters()
            read_bytes, write_bytes = io.read_bytes, io.write_bytes
        except (psutil.AccessDenied, AttributeError):
            read_bytes = write_bytes = None
    return Usage(
        cpu_user=cpu.user,
        cpu_system=cpu.system,
        cpu_iowait=getattr(cpu, "iowait", None),
        rss=mem.rss,
        threads=threads,
        fds=fds,
        read_bytes=read_bytes,
        write_bytes=write_bytes,
        ctx_voluntary=ctx.voluntary,
        ctx_involuntary=ctx.involuntary,
    )


def read_uss(proc: psutil.Process) -> int | None:
    """Unique set size (reads /proc/PID/smaps: a few ms, so DataLoader workers only).
    None where the platform or permissions don't allow it."""
    try:
        return getattr(proc.memory_full_info(), "uss", None)
    except psutil.AccessDenied:
        return None


class HostSource:
    name = "host"

    def __init__(
        self,
        interval: float = 1.0,
        reader: Callable[[psutil.Process], Usage] = read_usage,
        process_factory: Callable[[int], psutil.Process] = psutil.Process,
        uss_reader: Callable[[psutil.Process], int | None] = read_uss,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``reader``, ``uss_reader`` and ``process_factory`` are injectable so tests can feed readings."""
        self.interval = interval
        self._read = reader
        self._read_uss = uss_reader
        self._new_process = process_factory
        self._clock = clock
        self._uss: dict[tuple[int, float], tuple[float, int | None]] = {}  # key -> (read at, USS)
        self._procs: dict[tuple[int, float], psutil.Process] = {}
        self._last: dict[tuple[int, float], tuple[Group, Usage]] = {}
        self._retired: dict[Group, Usage] = {}

    def start(self) -> None:
        psutil.cpu_percent(None)  # prime: the first call has no interval to measure

    def stop(self) -> None:
        self._procs.clear()

    def _process(self, info: ProcessInfo) -> psutil.Process:
        key = (info.pid, info.create_time)
        proc = self._procs.get(key)
        if proc is None:
            proc = self._procs[key] = self._new_process(info.pid)
        return proc

    def _worker_uss(self, key: tuple[int, float], proc: psutil.Process) -> int | None:
        now = self._clock()
        cached = self._uss.get(key)
        if cached is None or now - cached[0] >= USS_EVERY:
            cached = self._uss[key] = (now, self._read_uss(proc))
        return cached[1]

    def collect(self, tree: ProcessTree) -> HostSnapshot:
        current: dict[tuple[int, float], tuple[Group, Usage]] = {}
        counts: dict[Group, int] = {}
        # Jobs still listed (watch mode keeps an ended job for its grace period) keep
        # their retired counters; a job no longer listed takes its groups with it.
        live_jobs = {p.job_id for p in tree.processes} | set(tree.job_status())
        for info in tree.processes:
            key = (info.pid, info.create_time)
            group = (info.job_id, info.rank, info.role)
            try:
                proc = self._process(info)
                usage = self._read(proc)
                if info.role == ROLE_DATALOADER and usage.uss is None:
                    usage = replace(usage, uss=self._worker_uss(key, proc))
            except psutil.Error:
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
        self._retired = {g: u for g, u in self._retired.items() if g[0] in live_jobs}

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

"""Stacks source: continuous py-spy sampling of every rank's main process.

A ``Sampler`` thread (agent/sampler.py) keeps one ``py-spy record --format raw`` window
running per sampled process, back to back, plus a periodic ``py-spy dump --json`` for
thread states. Why windows and not dump polling: see bench/pyspy_modes.py and
docs/stacks.md.

``collect()`` only folds finished windows into counters and returns a snapshot: no
py-spy run happens on a scrape. A bounded ring of folded stacks per rank feeds
``/api/stacks``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from profagent.analysis.stacks import (
    CATEGORIES,
    Frame,
    Place,
    Sample,
    StallTracker,
    TopK,
    classify_with_idle,
    remember_idle_places,
)
from profagent.config import StacksConfig
from profagent.errors import SourceUnavailable
from profagent.logs import LogOnce
from profagent.sources.stacks import pyspy
from profagent.sources.stacks.sampler import Result, Sampler
from profagent.target import ROLE_DATALOADER, ROLE_MAIN, ProcessTree

log = logging.getLogger(__name__)

RING_MAX_BYTES = 4 << 20  # per rank
JOB_MEMORY_SECONDS = 60.0  # how long a pid's job is remembered after it left the targets
RING_MAX_LINES = 5000  # distinct stacks kept per window

GpuBusy = Callable[[str, str], "bool | None"]  # (rank, job_id) -> GPUs busy? None: unknown


@dataclass(frozen=True)
class StackGroup:
    """Cumulative counts of one (rank, role): main-thread samples by category and by leaf
    function (top-K), and all threads' states from periodic dumps."""

    rank: str
    role: str
    categories: tuple[tuple[str, int], ...]
    functions: tuple[tuple[str, int], ...]
    threads: tuple[tuple[str, str, int], ...]  # (state, gil, count)
    job_id: str = ""


@dataclass(frozen=True)
class RankStall:
    """A rank's main thread: whether it is stalled, and where it is now.

    ``frames`` is the main thread's most frequent stack in the last window (root first),
    kept for every rank so the findings can tell the rank that holds a collective up from
    those waiting in it.
    """

    rank: str
    stalled: bool
    unchanged_seconds: float
    job_id: str = ""
    frames: tuple[Frame, ...] = ()


@dataclass(frozen=True)
class StacksSnapshot:
    job_id: str
    groups: tuple[StackGroup, ...]
    stalls: tuple[RankStall, ...]
    errors: tuple[tuple[str, int], ...]


class StacksSource:
    name = "stacks"

    def __init__(
        self,
        config: StacksConfig,
        interval: float = 1.0,
        gpu_busy: GpuBusy | None = None,
        binary: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        proc_root: str = "/proc",
    ) -> None:
        self.config = config
        self.interval = interval
        self.gpu_busy = gpu_busy
        self._binary = binary
        self._clock, self._wall = clock, wall
        self._proc_root = proc_root
        self._lock = threading.Lock()  # guards the ring (read by HTTP threads)
        self._sampler: Sampler | None = None
        self._checked: set[int] = set()  # pids whose Python version was checked
        self._readable: set[int] = set()  # pids py-spy has read at least once
        self._fatal = ""
        self._version: tuple[int, ...] = ()
        # aggregates, touched only by collect(); keyed by (job_id, rank, role) or (job_id, rank)
        self._job_of: dict[int, tuple[str, float]] = {}  # pid -> (job_id, last wanted); watch mode has several jobs
        self._categories: dict[tuple[str, str, str], dict[str, int]] = {}
        self._topk: dict[tuple[str, str, str], TopK] = {}
        self._threads: dict[tuple[str, str, str], dict[tuple[str, str], int]] = {}
        self._idle_places: dict[tuple[str, str, str], dict[Place, None]] = {}  # lines dumps saw idle
        self._stalls: dict[tuple[str, str], StallTracker] = {}
        self._stall_state: dict[tuple[str, str], tuple[bool, float, tuple[Frame, ...]]] = {}
        self._errors: dict[str, int] = {}
        self._log_once = LogOnce(log)
        # ring: (job_id, rank) -> deque of (wall_end, {folded line: count}, bytes)
        self._ring: dict[tuple[str, str], deque] = {}
        self._ring_bytes: dict[tuple[str, str], int] = {}

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Find py-spy and start the sampler thread. Raises SourceUnavailable."""
        self._binary = self._binary or pyspy.find_pyspy()  # raises PySpyProblem, an Unavailable
        self._version = pyspy.pyspy_version(self._binary)
        self._sampler = Sampler(self._binary, self.config, self._clock, self._wall)
        self._sampler.start()

    def stop(self) -> None:
        """Stop sampling: every py-spy child is gone when this returns (< 1 s)."""
        if self._sampler is not None:
            self._sampler.stop()

    # -- collect -------------------------------------------------------------------------------
    def collect(self, tree: ProcessTree) -> StacksSnapshot:
        """Fold finished windows into the counters. Raises SourceUnavailable when py-spy
        cannot read the target (ptrace denied, unsupported Python)."""
        if self._fatal:
            raise SourceUnavailable(self._fatal)
        assert self._sampler is not None, "start() first"
        self._sampler.set_targets(self._targets(tree))
        for r in self._sampler.drain():
            self._fold(r)
        if self._fatal:
            raise SourceUnavailable(self._fatal)
        self._forget_ended_jobs(tree)
        return self._snapshot(tree.job_id)

    def _forget_ended_jobs(self, tree: ProcessTree) -> None:
        """A job that left the tree (watch mode, after its grace) takes its series along."""
        live = set(tree.job_status())
        for table in (self._categories, self._topk, self._threads, self._idle_places, self._stalls, self._stall_state):
            for key in [k for k in table if k[0] not in live]:
                del table[key]
        with self._lock:
            for key in [k for k in self._ring if k[0] not in live]:
                del self._ring[key]
                self._ring_bytes.pop(key, None)

    def _targets(self, tree: ProcessTree) -> dict[int, tuple[str, str]]:
        roles = (ROLE_MAIN, ROLE_DATALOADER) if self.config.dataloader else (ROLE_MAIN,)
        wanted = {p.pid: (p.rank, p.role) for p in tree.processes if p.role in roles}
        now = self._clock()
        self._job_of.update({p.pid: (p.job_id, now) for p in tree.processes if p.pid in wanted})
        for pid in wanted:
            if pid in self._checked:
                continue
            self._checked.add(pid)
            problem = pyspy.compatibility(self._version, pyspy.target_python(pid, self._proc_root))
            if problem:
                self._fatal = problem
                raise SourceUnavailable(problem, reason="unsupported_python")
        self._checked &= set(wanted)
        self._readable &= set(wanted)
        # A window of a process that just left may still be in flight: remember jobs a while.
        self._job_of = {pid: v for pid, v in self._job_of.items() if now - v[1] < JOB_MEMORY_SECONDS}
        return wanted

    def _job(self, pid: int) -> str:
        return self._job_of.get(pid, ("", 0.0))[0]

    def _fold(self, r: Result) -> None:
        group = (self._job(r.pid), r.rank, r.role)
        if r.error:
            self._error(r)
            return
        self._readable.add(r.pid)
        if r.kind == "dump":
            counts = self._threads.setdefault(group, {})
            for key, n in r.states.items():
                counts[key] = counts.get(key, 0) + n
            remember_idle_places(self._idle_places.setdefault(group, {}), r.idle)
            return
        cats = self._categories.setdefault(group, dict.fromkeys(CATEGORIES, 0))
        functions: dict[str, int] = {}
        main = [s for s in r.samples if s.main]
        idle_at = self._idle_places.get(group, {})
        for s in main:
            cats[classify_with_idle(s.frames, idle_at)] += s.count
            if s.leaf is not None:
                functions[s.leaf.function] = functions.get(s.leaf.function, 0) + s.count
        topk = self._topk.setdefault(group, TopK(self.config.top_k))
        topk.add(functions, r.end - r.start)
        self._remember(r)
        if r.role == ROLE_MAIN:
            self._check_stall(r, main)

    def _error(self, r: Result) -> None:
        if r.error == "target_gone":
            return  # a process that exits mid-window is normal, not an error
        if r.error == "permission" and r.pid not in self._readable:
            self._fatal = f"ptrace denied on PID {r.pid}, so py-spy cannot read its stacks: {pyspy.PTRACE_FIX}"
            return  # (once read, a denial is transient: e.g. another tracer attached for a moment)
        self._errors[r.error] = self._errors.get(r.error, 0) + 1
        self._log_once(logging.WARNING, (r.error, r.detail),
                       "stacks: py-spy on PID %d (rank %s): %s", r.pid, r.rank, r.detail or r.error)

    def _check_stall(self, r: Result, main: list[Sample]) -> None:
        job = self._job(r.pid)
        tracker = self._stalls.setdefault((job, r.rank), StallTracker(self.config.stall_seconds))
        busy = None
        if self.gpu_busy is not None:
            try:
                busy = self.gpu_busy(r.rank, job)
            except Exception:  # the GPU hook is someone else's: never let it break stacks
                busy = None
        status = tracker.update(main, r.start, r.end, busy)
        was = self._stall_state.get((job, r.rank), (False, 0.0, ()))[0]
        self._stall_state[(job, r.rank)] = (status.stalled, status.unchanged_seconds, _dominant(main))
        if status.started:
            gpu = "no GPU signal" if busy is None else "its GPUs idle"
            frames = "\n".join(f"    {f}" for f in status.frames)
            log.warning(
                "rank %s stalled: main thread stack unchanged for %.0f s (%s); stack, innermost last:\n%s",
                r.rank, status.unchanged_seconds, gpu, frames,
            )
        elif was and not status.stalled:
            log.info("rank %s is moving again", r.rank)

    def _remember(self, r: Result) -> None:
        lines: dict[str, int] = {}
        prefix = "" if r.role == ROLE_MAIN else f"{r.role} worker;"
        for s in r.samples[:RING_MAX_LINES]:
            key = prefix + s.folded
            lines[key] = lines.get(key, 0) + s.count
        size = sum(len(k) + 8 for k in lines)
        key = (self._job(r.pid), r.rank)
        with self._lock:
            ring = self._ring.setdefault(key, deque())
            ring.append((r.wall_end, lines, size))
            total = self._ring_bytes.get(key, 0) + size
            horizon = r.wall_end - self.config.ring_seconds
            while ring and (ring[0][0] < horizon or total > RING_MAX_BYTES):
                total -= ring.popleft()[2]
            self._ring_bytes[key] = total

    def _snapshot(self, job_id: str) -> StacksSnapshot:
        groups = []
        for group in sorted(set(self._categories) | set(self._threads)):
            cats = self._categories.get(group, {})
            topk = self._topk.get(group)
            threads = self._threads.get(group, {})
            groups.append(StackGroup(
                group[1], group[2],
                tuple(cats.items()),
                tuple(topk.series()) if topk else (),
                tuple((state, gil, n) for (state, gil), n in sorted(threads.items())),
                job_id=group[0],
            ))
        stalls = tuple(RankStall(rank, s, u, job, frames)
                       for (job, rank), (s, u, frames) in sorted(self._stall_state.items()))
        return StacksSnapshot(job_id, tuple(groups), stalls, tuple(sorted(self._errors.items())))

    # -- /api/stacks ----------------------------------------------------------------------------
    def ranks(self) -> list[tuple[str, str]]:
        """(job_id, rank) pairs with stacks in the ring."""
        with self._lock:
            return sorted(self._ring)

    def folded(self, rank: str, seconds: float, job_id: str | None = None) -> str:
        """Collapsed stacks of ``rank`` over the last ``seconds`` (one ``stack count`` a line)."""
        horizon = self._wall() - seconds
        totals: dict[str, int] = {}
        with self._lock:
            windows = [lines for (job, r), ring in self._ring.items() if r == rank and job_id in (None, job)
                       for end, lines, _ in ring if end >= horizon]
        for lines in windows:
            for stack, n in lines.items():
                totals[stack] = totals.get(stack, 0) + n
        return "".join(f"{stack} {n}\n" for stack, n in sorted(totals.items()))

    def route(self, query: dict[str, list[str]]) -> tuple[int, str, bytes]:
        """GET /api/stacks?rank=R&seconds=S[&job=J] -> folded stacks as text/plain."""
        keys = self.ranks()
        job = (query.get("job") or [None])[0]
        rank = (query.get("rank") or [""])[0]
        known = ", ".join(f"{r} (job {j})" if j else r for j, r in keys) or "none yet"
        if not rank:
            if len(keys) != 1:
                return 400, "text/plain", f"rank=R is required (sampled ranks: {known})\n".encode()
            job, rank = keys[0]
        try:
            seconds = float((query.get("seconds") or ["60"])[0])
        except ValueError:
            return 400, "text/plain", b"seconds=S must be a number\n"
        matches = [(j, r) for j, r in keys if r == rank and job in (None, j)]
        if not matches:
            return 404, "text/plain", f"no stacks for rank {rank} (sampled ranks: {known})\n".encode()
        if len({j for j, _ in matches}) > 1:
            return 400, "text/plain", f"rank {rank} exists in several jobs: add job=J (sampled ranks: {known})\n".encode()
        seconds = min(max(seconds, 0.0), self.config.ring_seconds)
        return 200, "text/plain; charset=utf-8", self.folded(rank, seconds, matches[0][0]).encode()


def _dominant(main: list[Sample]) -> tuple[Frame, ...]:
    """The main thread's most sampled stack of one window (root first); () without samples."""
    counts: dict[str, int] = {}
    frames: dict[str, tuple[Frame, ...]] = {}
    for s in main:
        counts[s.folded] = counts.get(s.folded, 0) + s.count
        frames[s.folded] = s.frames
    return frames[max(counts, key=lambda k: (counts[k], k))] if counts else ()


def stacks_route(sources: Callable[[], list[StacksSource]]) -> Callable[[dict[str, list[str]]], tuple[int, str, bytes]]:
    """The handler of GET /api/stacks over every running stacks source (one per job)."""

    def route(query: dict[str, list[str]]) -> tuple[int, str, bytes]:
        live = sources()
        if not live:
            return 503, "text/plain", b"the stacks source is off (see profagent_collector_up and the agent log)\n"
        rank = (query.get("rank") or [""])[0]
        for source in live:
            if not rank or rank in {r for _, r in source.ranks()}:
                return source.route(query)
        return live[0].route(query)

    return route

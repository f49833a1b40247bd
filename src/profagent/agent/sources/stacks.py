"""Stacks source: continuous py-spy sampling of every rank's main process.

A sampler thread keeps one ``py-spy record --format raw`` window running per sampled
process, back to back (a new window starts within ~50 ms of the previous one ending),
plus a ``py-spy dump --json`` every ``window`` seconds for thread states (active/idle,
GIL). Why windows and not dump polling: see bench/pyspy_modes.py and docs/stacks.md.

``collect()`` only folds finished windows into counters and returns a snapshot: no
py-spy run happens on a scrape. A bounded ring of folded stacks per rank feeds
``/api/stacks``.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from profagent.agent import pyspy
from profagent.agent.analysis.stacks import (
    CATEGORIES,
    Sample,
    StallTracker,
    TopK,
    classify,
    parse_folded,
    thread_states,
)
from profagent.agent.sources import SourceUnavailable
from profagent.agent.target import ROLE_DATALOADER, ROLE_MAIN, ProcessTree
from profagent.config import StacksConfig

log = logging.getLogger(__name__)

POLL = 0.05  # seconds between checks of the py-spy children
RETRY_AFTER = 5.0  # seconds before sampling a process again after py-spy failed on it,
RETRY_MAX = 300.0  # doubling on each consecutive failure up to this
RING_MAX_BYTES = 4 << 20  # per rank
RING_MAX_LINES = 5000  # distinct stacks kept per window

GpuBusy = Callable[[str], "bool | None"]


@dataclass(frozen=True)
class StackGroup:
    """Cumulative counts of one (rank, role): main-thread samples by category and by leaf
    function (top-K), and all threads' states from periodic dumps."""

    rank: str
    role: str
    categories: tuple[tuple[str, int], ...]
    functions: tuple[tuple[str, int], ...]
    threads: tuple[tuple[str, str, int], ...]  # (state, gil, count)


@dataclass(frozen=True)
class RankStall:
    rank: str
    stalled: bool
    unchanged_seconds: float


@dataclass(frozen=True)
class StacksSnapshot:
    job_id: str
    groups: tuple[StackGroup, ...]
    stalls: tuple[RankStall, ...]
    errors: tuple[tuple[str, int], ...]


@dataclass
class _Job:
    """A running py-spy child (a record window or a dump) and where its output goes."""

    kind: str  # "record" or "dump"
    pid: int
    rank: str
    role: str
    proc: subprocess.Popen
    out: Path
    err: Path
    start: float
    wall_start: float


@dataclass(frozen=True)
class _Result:
    kind: str
    pid: int
    rank: str
    role: str
    start: float
    end: float
    wall_end: float
    samples: tuple[Sample, ...] = ()
    states: dict = field(default_factory=dict)
    error: str = ""  # bounded reason, "" when fine
    detail: str = ""


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
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tmp: Path | None = None
        self._wanted: dict[int, tuple[str, str]] = {}  # pid -> (rank, role)
        self._jobs: dict[tuple[str, int], _Job] = {}  # (kind, pid) -> running child
        self._next: dict[tuple[str, int], float] = {}  # (kind, pid) -> earliest next start
        self._fails: dict[tuple[str, int], int] = {}  # (kind, pid) -> consecutive failures
        self._results: list[_Result] = []
        self._checked: set[int] = set()
        self._fatal = ""
        self._version: tuple[int, ...] = ()
        self._seq = 0
        # aggregates, touched only by collect()
        self._categories: dict[tuple[str, str], dict[str, int]] = {}
        self._topk: dict[tuple[str, str], TopK] = {}
        self._threads: dict[tuple[str, str], dict[tuple[str, str], int]] = {}
        self._stalls: dict[str, StallTracker] = {}
        self._stall_state: dict[str, tuple[bool, float]] = {}
        self._errors: dict[str, int] = {}
        self._logged: set[str] = set()
        # ring: rank -> deque of (wall_end, role, {folded: count}, bytes)
        self._ring: dict[str, deque] = {}
        self._ring_bytes: dict[str, int] = {}

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Find py-spy and start the sampler thread. Raises SourceUnavailable."""
        try:
            self._binary = self._binary or pyspy.find_pyspy()
        except pyspy.PySpyProblem as exc:
            raise SourceUnavailable(str(exc), exc.reason) from None
        self._version = pyspy.pyspy_version(self._binary)
        self._tmp = Path(tempfile.mkdtemp(prefix="profagent-stacks-"))
        self._thread = threading.Thread(target=self._run, name="profagent-pyspy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling: every py-spy child is gone when this returns (< 1 s)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
        with self._lock:
            jobs = list(self._jobs.values())
            self._jobs.clear()
        pyspy.stop_all([j.proc for j in jobs])  # the thread normally did it already
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    # -- the sampler thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.wait(POLL):
                try:
                    self._step()
                except Exception as exc:  # keep sampling; the error is counted and logged once
                    with self._lock:
                        self._results.append(_Result("record", 0, "", "", 0.0, 0.0, 0.0, error=type(exc).__name__, detail=str(exc)))
                    log.debug("stacks sampler step failed", exc_info=True)
        finally:
            with self._lock:
                jobs = list(self._jobs.values())
                self._jobs.clear()
            pyspy.stop_all([j.proc for j in jobs])
            if not self.config.nonblocking:
                for j in jobs:
                    pyspy.resume_if_stopped(j.pid)

    def _step(self) -> None:
        with self._lock:
            wanted = dict(self._wanted)
            jobs = dict(self._jobs)
        now = self._clock()
        done = []
        for key, job in list(jobs.items()):
            if job.proc.poll() is not None:
                done.extend(self._harvest(job, now))
                del jobs[key]
        for pid, (rank, role) in wanted.items():
            for kind in ("record", "dump"):
                key = (kind, pid)
                if key not in jobs and now >= self._next.get(key, 0.0):
                    job = self._launch(kind, pid, rank, role, now)
                    if job is not None:
                        jobs[key] = job
        for key in [k for k in self._next if k[1] not in wanted]:
            del self._next[key]
            self._fails.pop(key, None)
        with self._lock:
            self._jobs = jobs
            self._results.extend(done)

    def _launch(self, kind: str, pid: int, rank: str, role: str, now: float) -> _Job | None:
        assert self._tmp is not None and self._binary is not None
        self._seq += 1
        out = self._tmp / f"{kind}-{pid}-{self._seq}.out"
        err = self._tmp / f"{kind}-{pid}-{self._seq}.err"
        window = max(1, round(self.config.window))
        if kind == "record":
            args = pyspy.record_args(self._binary, pid, window, self.config.rate, "raw", out, self.config.nonblocking)
        else:
            args = pyspy.dump_args(self._binary, pid, self.config.nonblocking)
            self._next[(kind, pid)] = now + window
        try:
            proc = pyspy.spawn(args, err, stdout_path=out if kind == "dump" else None)
        except OSError as exc:
            self._next[(kind, pid)] = now + RETRY_AFTER
            with self._lock:
                self._results.append(_Result(kind, pid, rank, role, now, now, self._wall(), error="spawn", detail=str(exc)))
            return None
        return _Job(kind, pid, rank, role, proc, out, err, now, self._wall())

    def _harvest(self, job: _Job, now: float) -> list[_Result]:
        text = _read(job.out)
        stderr = _read(job.err)
        for path in (job.out, job.err):
            path.unlink(missing_ok=True)
        base = dict(kind=job.kind, pid=job.pid, rank=job.rank, role=job.role, start=job.start, end=now, wall_end=self._wall())
        extra = []
        if not self.config.nonblocking and pyspy.resume_if_stopped(job.pid):
            detail = f"PID {job.pid} was left stopped after a blocking py-spy sample: resumed it with SIGCONT"
            extra.append(_Result(**base, error="target_resumed", detail=detail))
        key = (job.kind, job.pid)
        if job.proc.returncode != 0 and not text.strip():
            reason = pyspy.failure_reason(stderr, job.pid)
            fails = self._fails[key] = self._fails.get(key, 0) + 1
            self._next[key] = now + min(RETRY_AFTER * 2 ** (fails - 1), RETRY_MAX)
            return [*extra, _Result(**base, error=reason, detail=pyspy.first_line(stderr))]
        self._fails.pop(key, None)
        if job.kind == "dump":
            try:
                return [*extra, _Result(**base, states=thread_states(json.loads(text)))]
            except ValueError:
                return [*extra, _Result(**base, error="parse", detail="py-spy dump printed invalid JSON")]
        return [*extra, _Result(**base, samples=tuple(parse_folded(text, job.pid)))]

    # -- collect -------------------------------------------------------------------------------
    def collect(self, tree: ProcessTree) -> StacksSnapshot:
        """Fold finished windows into the counters. Raises SourceUnavailable when py-spy
        cannot read the target (ptrace denied, unsupported Python)."""
        if self._fatal:
            raise SourceUnavailable(self._fatal, "unavailable")
        wanted = self._targets(tree)
        with self._lock:
            self._wanted = wanted
            results, self._results = self._results, []
        for r in results:
            self._fold(r)
        if self._fatal:
            raise SourceUnavailable(self._fatal, "unavailable")
        return self._snapshot(tree.job_id)

    def _targets(self, tree: ProcessTree) -> dict[int, tuple[str, str]]:
        roles = (ROLE_MAIN, ROLE_DATALOADER) if self.config.dataloader else (ROLE_MAIN,)
        wanted = {p.pid: (p.rank, p.role) for p in tree.processes if p.role in roles}
        for pid in wanted:
            if pid in self._checked:
                continue
            self._checked.add(pid)
            problem = pyspy.compatibility(self._version, pyspy.target_python(pid, self._proc_root))
            if problem:
                self._fatal = problem
                raise SourceUnavailable(problem, "unsupported_python")
        self._checked &= set(wanted)
        return wanted

    def _fold(self, r: _Result) -> None:
        group = (r.rank, r.role)
        if r.error:
            self._error(r)
            return
        if r.kind == "dump":
            counts = self._threads.setdefault(group, {})
            for key, n in r.states.items():
                counts[key] = counts.get(key, 0) + n
            return
        cats = self._categories.setdefault(group, dict.fromkeys(CATEGORIES, 0))
        functions: dict[str, int] = {}
        main = [s for s in r.samples if s.main]
        for s in main:
            cats[classify(s.frames)] += s.count
            if s.leaf is not None:
                functions[s.leaf.function] = functions.get(s.leaf.function, 0) + s.count
        topk = self._topk.setdefault(group, TopK(self.config.top_k))
        topk.add(functions, r.end - r.start)
        self._remember(r)
        if r.role == ROLE_MAIN:
            self._check_stall(r, main)

    def _error(self, r: _Result) -> None:
        if r.error == "target_gone":
            return  # a process that exits mid-window is normal, not an error
        if r.error == "permission":
            self._fatal = f"ptrace denied on PID {r.pid}, so py-spy cannot read its stacks: {pyspy.PTRACE_FIX}"
            return
        self._errors[r.error] = self._errors.get(r.error, 0) + 1
        key = f"{r.error}:{r.detail}"
        if key not in self._logged:
            self._logged.add(key)
            log.warning("stacks: py-spy on PID %d (rank %s): %s", r.pid, r.rank, r.detail or r.error)

    def _check_stall(self, r: _Result, main: list[Sample]) -> None:
        tracker = self._stalls.setdefault(r.rank, StallTracker(self.config.stall_seconds))
        busy = None
        if self.gpu_busy is not None:
            try:
                busy = self.gpu_busy(r.rank)
            except Exception:  # the GPU hook is someone else's: never let it break stacks
                busy = None
        status = tracker.update(main, r.start, r.end, busy)
        was = self._stall_state.get(r.rank, (False, 0.0))[0]
        self._stall_state[r.rank] = (status.stalled, status.unchanged_seconds)
        if status.started:
            gpu = "no GPU signal" if busy is None else "its GPUs idle"
            frames = "\n".join(f"    {f}" for f in status.frames)
            log.warning(
                "rank %s stalled: main thread stack unchanged for %.0f s (%s); stack, innermost last:\n%s",
                r.rank, status.unchanged_seconds, gpu, frames,
            )
        elif was and not status.stalled:
            log.info("rank %s is moving again", r.rank)

    def _remember(self, r: _Result) -> None:
        lines: dict[str, int] = {}
        prefix = "" if r.role == ROLE_MAIN else f"{r.role} worker;"
        for s in r.samples[:RING_MAX_LINES]:
            key = prefix + s.folded
            lines[key] = lines.get(key, 0) + s.count
        size = sum(len(k) + 8 for k in lines)
        with self._lock:
            ring = self._ring.setdefault(r.rank, deque())
            ring.append((r.wall_end, lines, size))
            total = self._ring_bytes.get(r.rank, 0) + size
            horizon = r.wall_end - self.config.ring_seconds
            while ring and (ring[0][0] < horizon or total > RING_MAX_BYTES):
                total -= ring.popleft()[2]
            self._ring_bytes[r.rank] = total

    def _snapshot(self, job_id: str) -> StacksSnapshot:
        groups = []
        for group in sorted(set(self._categories) | set(self._threads)):
            cats = self._categories.get(group, {})
            topk = self._topk.get(group)
            threads = self._threads.get(group, {})
            groups.append(StackGroup(
                group[0], group[1],
                tuple(cats.items()),
                tuple(topk.series()) if topk else (),
                tuple((state, gil, n) for (state, gil), n in sorted(threads.items())),
            ))
        stalls = tuple(RankStall(rank, s, u) for rank, (s, u) in sorted(self._stall_state.items()))
        return StacksSnapshot(job_id, tuple(groups), stalls, tuple(sorted(self._errors.items())))

    # -- /api/stacks ----------------------------------------------------------------------------
    def ranks(self) -> list[str]:
        with self._lock:
            return sorted(self._ring)

    def folded(self, rank: str, seconds: float) -> str:
        """Collapsed stacks of ``rank`` over the last ``seconds`` (one ``stack count`` a line)."""
        horizon = self._wall() - seconds
        totals: dict[str, int] = {}
        with self._lock:
            windows = [lines for end, lines, _ in self._ring.get(rank, ()) if end >= horizon]
        for lines in windows:
            for stack, n in lines.items():
                totals[stack] = totals.get(stack, 0) + n
        return "".join(f"{stack} {n}\n" for stack, n in sorted(totals.items()))

    def route(self, query: dict[str, list[str]]) -> tuple[int, str, bytes]:
        """GET /api/stacks?rank=R&seconds=S -> folded stacks as text/plain."""
        ranks = self.ranks()
        rank = (query.get("rank") or [""])[0]
        if not rank:
            if len(ranks) != 1:
                known = ", ".join(ranks) or "none yet"
                return 400, "text/plain", f"rank=R is required (sampled ranks: {known})\n".encode()
            rank = ranks[0]
        try:
            seconds = float((query.get("seconds") or ["60"])[0])
        except ValueError:
            return 400, "text/plain", b"seconds=S must be a number\n"
        if rank not in ranks:
            return 404, "text/plain", f"no stacks for rank {rank} (sampled ranks: {', '.join(ranks) or 'none yet'})\n".encode()
        seconds = min(max(seconds, 0.0), self.config.ring_seconds)
        return 200, "text/plain; charset=utf-8", self.folded(rank, seconds).encode()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def stacks_route(sources: Callable[[], list[StacksSource]]) -> Callable[[dict[str, list[str]]], tuple[int, str, bytes]]:
    """The handler of GET /api/stacks over every running stacks source (one per job)."""

    def route(query: dict[str, list[str]]) -> tuple[int, str, bytes]:
        live = sources()
        if not live:
            return 503, "text/plain", b"the stacks source is off (see profagent_collector_up and the agent log)\n"
        rank = (query.get("rank") or [""])[0]
        for source in live:
            if not rank or rank in source.ranks():
                return source.route(query)
        return live[0].route(query)

    return route

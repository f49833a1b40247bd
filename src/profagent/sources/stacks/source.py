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

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from profagent.analysis.collectives import (
    WaitRatios,
    moving,
    native_waits,
    python_frames,
    python_only,
)
from profagent.analysis.stacks import (
    CATEGORIES,
    Place,
    Sample,
    StallTracker,
    TopK,
    classify,
    classify_with_idle,
    fetching,
    remember_idle_places,
    standing_key,
    waits_on_dataloader,
)
from profagent.config import StacksConfig
from profagent.contracts import (
    ROLE_DATALOADER,
    ROLE_MAIN,
    Frame,
    ProcessTree,
    RankStall,
    StackGroup,
    StacksSnapshot,
    WorkerStall,
)
from profagent.errors import SourceUnavailable
from profagent.logs import LogOnce
from profagent.sources.stacks import pyspy
from profagent.sources.stacks.sampler import Result, Sampler

log = logging.getLogger(__name__)

RING_MAX_BYTES = 4 << 20  # per rank
JOB_MEMORY_SECONDS = 60.0  # how long a pid's job is remembered after it left the targets
RING_MAX_LINES = 5000  # distinct stacks kept per window

GpuBusy = Callable[[str, str], "bool | None"]  # (rank, job_id) -> GPUs busy? None: unknown
JobHot = Callable[[str], bool]  # job_id -> a finding is active on the job
WATCH_HOLD = 30.0  # seconds of full rate after `profagent top` or /api/stacks last asked
# A rank whose last window began before another rank of its job stalled is shown as it was
# before the job stopped: the hang verdict waits for its next window, this long at most past
# the longest window (py-spy start-up and harvest, longer on a loaded node)
STALE_GRACE = 15.0



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
        self.job_hot: JobHot | None = None  # set by the engine: full rate while the job has a finding
        self._first_seen: dict[int, float] = {}  # pid -> when it was first wanted
        self._watched_until = float("-inf")
        self._binary = binary
        self._clock, self._wall = clock, wall
        self._proc_root = proc_root
        self._lock = threading.Lock()  # guards the ring (read by HTTP threads)
        self._sampler: Sampler | None = None
        self._checked: set[int] = set()  # pids whose Python version was checked
        self._readable: set[int] = set()  # pids py-spy has read at least once
        self._windowed: set[int] = set()  # pids with a record window folded
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
        # collective waits, per (job_id, rank): see analysis/collectives.WaitRatios
        self._ratios: dict[tuple[str, str], WaitRatios] = {}
        self._judged: dict[tuple[str, str], tuple[int, float]] = {}  # cumulative (samples, waits)
        self._last_native: dict[tuple[str, str], float] = {}  # clock of the last native request
        self._native_pending: dict[tuple[str, str], tuple[int, float]] = {}  # -> (pid, asked at)
        self._native_stack: dict[tuple[str, str], NativeLook] = {}  # the last native window's main stack
        self._steady: dict[tuple[str, str], bool] = {}  # the rank's last window was steady
        self._looked: dict[tuple[str, str], tuple[float, float]] = {}  # (start, end) of its last main window
        self._mains: dict[tuple[str, str], int] = {}  # (job_id, rank) -> pid of its main process
        # DataLoader workers of ranks waiting for their DataLoader: (job_id, rank) -> pid -> look
        self._workers: dict[tuple[str, str], dict[int, WorkerLook]] = {}
        self._worker_pids: dict[tuple[str, str], set[int]] = {}  # the workers sampled now
        self._rank_workers: dict[tuple[str, str], set[int]] = {}  # every DataLoader worker of each rank
        self._errors: dict[tuple[str, str], int] = {}  # (job_id, reason) -> failed py-spy runs
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
        wanted = self._targets(tree)
        self._sampler.set_targets(wanted)
        for r in self._sampler.drain():
            self._fold(r)
        self._sampler.set_pace(self._pace(wanted))
        if self._fatal:
            raise SourceUnavailable(self._fatal)
        self._forget_ended_jobs(tree)
        return self._snapshot(tree.job_id)

    def _forget_ended_jobs(self, tree: ProcessTree) -> None:
        """A job that left the tree (watch mode, after its grace) takes its series along."""
        live = set(tree.job_status())
        expired = tree.expired_ranks
        for table in (self._categories, self._topk, self._threads, self._idle_places, self._stalls, self._stall_state,
                      self._ratios, self._judged, self._last_native, self._native_stack, self._steady,
                      self._native_pending, self._looked, self._workers, self._worker_pids):
            for key in [k for k in table if k[0] not in live or (k[0], k[1]) in expired]:
                del table[key]
        # errors of no job ("": the sampler itself failed) are the agent's: they stay
        for key in [k for k in self._errors if k[0] and k[0] not in live]:
            del self._errors[key]
        with self._lock:
            for key in [k for k in self._ring if k[0] not in live or (k[0], k[1]) in expired]:
                del self._ring[key]
                self._ring_bytes.pop(key, None)

    def _targets(self, tree: ProcessTree) -> dict[int, tuple[str, str]]:
        roles = (ROLE_MAIN, ROLE_DATALOADER) if self.config.dataloader else (ROLE_MAIN,)
        wanted = {p.pid: (p.rank, p.role) for p in tree.processes if p.role in roles}
        # the workers of a rank whose main thread stands still waiting for its DataLoader: a
        # worker that hangs holds the rank up, and only its own stack says where
        waiting = {key for key, (_, unchanged, frames) in self._stall_state.items()
                   if unchanged > 0 and waits_on_dataloader(frames)}
        self._worker_pids, self._rank_workers = {}, {}
        for p in tree.processes:
            if p.role == ROLE_DATALOADER:
                self._rank_workers.setdefault((p.job_id, p.rank), set()).add(p.pid)
            if p.role == ROLE_DATALOADER and (p.job_id, p.rank) in waiting:
                wanted[p.pid] = (p.rank, p.role)
                self._worker_pids.setdefault((p.job_id, p.rank), set()).add(p.pid)
        for key in list(self._workers):
            live = self._worker_pids.get(key, set())
            self._workers[key] = {pid: look for pid, look in self._workers[key].items() if pid in live}
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
        self._mains = {(p.job_id, p.rank): p.pid for p in tree.processes if p.role == ROLE_MAIN and p.pid in wanted}
        self._checked &= set(wanted)
        self._readable &= set(wanted)
        self._windowed &= set(wanted)
        # A window of a process that just left may still be in flight: remember jobs a while.
        self._job_of = {pid: v for pid, v in self._job_of.items() if now - v[1] < JOB_MEMORY_SECONDS}
        return wanted

    # -- pace -----------------------------------------------------------------------------------
    def watched(self) -> None:
        """Someone looks at this job's stacks (`profagent top`, /api/stacks): full rate a while."""
        self._watched_until = self._clock() + WATCH_HOLD

    def _pace(self, wanted: dict[int, tuple[str, str]]) -> dict[int, tuple[int, float]]:
        """Each process' next windows: the full rate while it warms up, while its job has a
        finding or a stall suspected (a window with one unchanged stack), and while watched;
        the steady rate otherwise. py-spy's cost is mostly per window and per sample."""
        cfg, now = self.config, self._clock()
        self._first_seen = {pid: self._first_seen.get(pid, now) for pid in wanted}
        full, steady = (cfg.rate, cfg.window), (cfg.steady_rate, cfg.steady_window)
        if cfg.steady_rate <= 0 or now < self._watched_until:
            return dict.fromkeys(wanted, full)
        # a stall suspected in any rank: every rank of its job at full rate, so the hang
        # verdict reads each rank as it is now, not from a long steady window
        suspects = {job for (job, _), state in self._stall_state.items() if state[1] > 0}
        pace = {}
        for pid in wanted:
            job = self._job(pid)
            pace[pid] = full if (now - self._first_seen[pid] < cfg.warmup_seconds or job in suspects
                                 or self._hot(job)) else steady
        return pace

    def _hot(self, job: str) -> bool:
        if self.job_hot is None:
            return False
        try:
            return self.job_hot(job)
        except Exception:  # the engine's hook: never let it break stacks
            return False

    def _job(self, pid: int) -> str:
        return self._job_of.get(pid, ("", 0.0))[0]

    def _fold(self, r: Result) -> None:
        group = (self._job(r.pid), r.rank, r.role)
        if r.error:
            if r.native:
                self._native_pending.pop(group[:2], None)
            self._error(r)
            return
        self._readable.add(r.pid)
        if r.kind == "dump":
            counts = self._threads.setdefault(group, {})
            for key, n in r.states.items():
                counts[key] = counts.get(key, 0) + n
            remember_idle_places(self._idle_places.setdefault(group, {}), r.idle)
            if r.pid not in self._windowed:  # a first look, within a second, until the first window
                self._count_main(group, list(r.samples), r.end - r.start)
            return
        self._windowed.add(r.pid)
        native_main = [s for s in r.samples if s.main] if r.native else []
        if r.native:  # from here on a native window is a plain one; its native frames served below
            r = dataclasses.replace(r, samples=tuple(python_only(s) for s in r.samples))
        main = [s for s in r.samples if s.main]
        self._count_main(group, main, r.end - r.start)
        self._remember(r)
        if r.role == ROLE_DATALOADER:
            self._check_worker(group[:2], r.pid, main, r.start, r.end)
        if r.role == ROLE_MAIN:
            self._count_waits(group[:2], main, native_main if r.native else None)
            self._check_stall(r, main)
            self._ask_native(r.pid, group[:2], main)

    def _count_main(self, group: tuple[str, str, str], main: list[Sample], seconds: float) -> None:
        """Main-thread samples into the category counters and the top-K leaf functions."""
        cats = self._categories.setdefault(group, dict.fromkeys(CATEGORIES, 0))
        functions: dict[str, int] = {}
        idle_at = self._idle_places.get(group, {})
        for s in main:
            cats[classify_with_idle(s.frames, idle_at)] += s.count
            if s.leaf is not None:
                functions[s.leaf.function] = functions.get(s.leaf.function, 0) + s.count
        self._topk.setdefault(group, TopK(self.config.top_k)).add(functions, seconds)

    def _error(self, r: Result) -> None:
        if r.error == "target_gone":
            return  # a process that exits mid-window is normal, not an error
        if r.error == "permission" and r.pid not in self._readable:
            self._fatal = f"ptrace denied on PID {r.pid}, so py-spy cannot read its stacks: {pyspy.PTRACE_FIX}"
            return  # (once read, a denial is transient: e.g. another tracer attached for a moment)
        key = (self._job(r.pid), r.error)
        self._errors[key] = self._errors.get(key, 0) + 1
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
        self._looked[(job, r.rank)] = (r.start, r.end)
        was = self._stall_state.get((job, r.rank), (False, 0.0, ()))[0]
        self._stall_state[(job, r.rank)] = (status.stalled, status.unchanged_seconds, _dominant(main))
        if status.started:
            gpu = "no GPU signal" if busy is None else "its GPUs idle"
            log.warning("rank %s stalled: main thread stack unchanged for %.0f s (%s); stack, innermost last:",
                        r.rank, status.unchanged_seconds, gpu, extra={"lines": [str(f) for f in status.frames]})
        elif was and not status.stalled:
            log.info("rank %s is moving again", r.rank)

    def _check_worker(self, key: tuple[str, str], pid: int, main: list[Sample], start: float, end: float) -> None:
        """One window of a DataLoader worker: does it stand still while it makes a batch?"""
        if pid not in self._worker_pids.get(key, set()):
            return  # sampled for config.stacks.dataloader only, or its rank moved on
        looks = self._workers.setdefault(key, {})
        look = looks.get(pid) or WorkerLook(StallTracker(self.config.stall_seconds))
        status = look.tracker.update(main, start, end, None)
        frames = _dominant(main)
        stuck = status.unchanged_seconds > 0 and fetching(frames)
        if stuck and not look.stuck:
            log.warning("rank %s: DataLoader worker PID %d stands still while making a batch; stack, innermost last:",
                        key[1], pid, extra={"lines": [str(f) for f in frames]})
        looks[pid] = WorkerLook(look.tracker, frames, stuck, status.unchanged_seconds)

    def _count_waits(self, key: tuple[str, str], main: list[Sample], native_main: list[Sample] | None) -> None:
        """Judged samples and collective waits of one main-thread window (see docs/stacks.md)."""
        ratios = self._ratios.setdefault(key, WaitRatios())
        if native_main is not None:
            self._native_pending.pop(key, None)
            if not _steady(main):
                log.debug("stacks: rank %s: native window during start-up, not learned", key[1])
                return  # a window of start-up (imports) teaches nothing about the rank's waits
            ratios.learn(native_main)
            log.debug("stacks: rank %s: native window learned %d stacks", key[1], len(native_main))
            waits = float(native_waits(native_main))
            if native_main:
                top = _dominant(native_main)
                self._native_stack[key] = NativeLook(python_frames(top), top, moving(native_main, top), self._clock())
        elif ratios.learned:
            waits = ratios.waits(main)
        else:
            return  # not judged before a native window has said what the rank's waits look like
        judged, total = self._judged.get(key, (0, 0.0))
        self._judged[key] = (judged + sum(s.count for s in main), total + waits)

    def _ask_native(self, pid: int, key: tuple[str, str], main: list[Sample]) -> None:
        """Ask for a native window when the stack stands still (a stall may start: is it a
        collective?) and, once the rank's stacks are steady, every native_every_seconds."""
        cfg = self.config
        self._steady[key] = _steady(main)
        now = self._clock()
        asked = self._native_pending.get(key)
        # an answer that cannot come: asked of another process (torchrun's launcher, seen as
        # rank 0 before it started the ranks; a restarted rank), or lost
        if asked is not None and (asked[0] != pid or now - asked[1] > max(30.0, 10 * cfg.window)):
            del self._native_pending[key]
            self._last_native.pop(key, None)  # never answered: ask again
        if not cfg.native or self._sampler is None or key in self._native_pending or not main:
            return
        last = self._last_native.get(key)
        stall = self._stall_state.get(key)
        look = self._native_stack.get(key)
        # a stack standing still: look at its native frames, and again every half stall_seconds
        # (a rank computing for long in one C++ call may stop there later)
        standing = stall is not None and stall[1] > 0 and (
            look is None or look.python != stall[2] or now - look.at >= cfg.stall_seconds / 2)
        retried_soon = last is not None and now - last < max(cfg.window, 1.0) * 2
        if standing and not retried_soon:
            self._native(key, pid, now)
        elif cfg.native_every_seconds > 0 and self._steady[key] and (
                last is None or now - last >= cfg.native_every_seconds):
            # every steady rank of the job at once: a native window slows the rank it samples
            # (py-spy pauses it at each sample), so a rank sampled alone would wait less then
            ranks = {k: p for k, p in self._mains.items() if k[0] == key[0]}
            ranks[key] = pid
            for other, other_pid in ranks.items():
                if self._steady.get(other) and other not in self._native_pending:
                    self._native(other, other_pid, now)

    def _native(self, key: tuple[str, str], pid: int, now: float) -> None:
        assert self._sampler is not None
        log.debug("stacks: rank %s: native window asked for", key[1])
        self._last_native[key] = now
        self._native_pending[key] = (pid, now)
        self._sampler.request_native(pid)

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
            judged, waits = self._judged.get(group[:2], (0, 0.0)) if group[2] == ROLE_MAIN else (0, 0.0)
            groups.append(StackGroup(
                group[1], group[2],
                tuple(cats.items()),
                tuple(topk.series()) if topk else (),
                tuple((state, gil, n) for (state, gil), n in sorted(threads.items())),
                job_id=group[0], judged=judged, collective_wait=waits,
            ))
        stalls = self._mark_stale([self._rank_stall(key, *state) for key, state in sorted(self._stall_state.items())])
        errors = tuple((job, reason, n) for (job, reason), n in sorted(self._errors.items()))
        return StacksSnapshot(job_id, tuple(groups), stalls, errors)

    def _rank_stall(self, key: tuple[str, str], stalled: bool, unchanged: float,
                    frames: tuple[Frame, ...]) -> RankStall:
        look = self._native_stack.get(key)
        same = look is not None and bool(frames) and standing_key(look.python) == standing_key(frames)
        # native frames that moved (outside any collective) since this stack stood still: the
        # rank computes in one long C++ call (a slow backward), it is not stuck
        moving = same and look.moving and look.at >= self._clock() - unchanged
        waiting = unchanged > 0 and waits_on_dataloader(frames)
        workers = tuple(WorkerStall(pid, w.stuck, w.unchanged, w.frames)
                        for pid, w in sorted(self._workers.get(key, {}).items())) if waiting else ()
        # its workers' first windows are on their way (asked for at the next collect); not for
        # ever: a worker py-spy cannot read must not hold the verdict back
        pending = (waiting and unchanged < self.config.stall_seconds + 2 * STALE_GRACE
                   and any(pid not in self._workers.get(key, {}) for pid in self._rank_workers.get(key, ())))
        # a rank waiting for a worker that stands still is stalled, whatever its poll loop does
        held = any(w.stuck and w.unchanged_seconds > self.config.stall_seconds for w in workers)
        return RankStall(key[1], (stalled and not moving) or held, unchanged, key[0], frames,
                         suspected=unchanged > 0 and not moving, native=look.frames if same else (),
                         native_pending=key in self._native_pending, workers=workers, workers_pending=pending,
                         window_age_seconds=max(0.0, self._clock() - self._looked.get(key, (self._clock(), 0.0))[0]))

    def _mark_stale(self, stalls: list[RankStall]) -> tuple[RankStall, ...]:
        """Mark the ranks whose last window began before another rank of their job stalled
        (``RankStall.stale``), while a newer window may still come."""
        now = self._clock()
        longest = max(self.config.window, self.config.steady_window if self.config.steady_rate > 0 else 0.0)
        began: dict[str, float] = {}  # job -> when its earliest stalled rank's stack stood still
        for s in stalls:
            if s.stalled:
                since = self._looked[(s.job_id, s.rank)][1] - s.unchanged_seconds
                began[s.job_id] = min(began.get(s.job_id, since), since)
        marked = []
        for s in stalls:
            start, end = self._looked.get((s.job_id, s.rank), (now, now))
            stale = (not s.stalled and s.job_id in began and start < began[s.job_id]
                     and now - end < longest + STALE_GRACE)
            marked.append(dataclasses.replace(s, stale=True) if stale else s)
        return tuple(marked)

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
        self.watched()
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


@dataclass(frozen=True)
class WorkerLook:
    """The last window of one DataLoader worker: its stall tracker, most sampled stack, and
    whether it stands still making a batch."""

    tracker: StallTracker
    frames: tuple[Frame, ...] = ()
    stuck: bool = False
    unchanged: float = 0.0


@dataclass(frozen=True)
class NativeLook:
    """What a native window saw of a rank's main thread: its most sampled stack (with and
    without native frames), whether the thread moved, and when (clock)."""

    python: tuple[Frame, ...]
    frames: tuple[Frame, ...]
    moving: bool
    at: float


def _steady(main: list[Sample]) -> bool:
    """A window of a rank past its start-up: no import, no torch.compile compiling."""
    return bool(main) and not any(
        classify(s.frames) == "compile" or any(f.file.startswith("<frozen importlib") for f in s.frames) for s in main)


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

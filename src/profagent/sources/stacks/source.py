"""Stacks source: continuous py-spy sampling of every rank's main process.

A ``Sampler`` thread (sources/stacks/sampler.py) keeps one ``py-spy record --format raw`` window
running per sampled process, back to back, plus a periodic ``py-spy dump --json`` for
thread states. Why windows and not dump polling: see bench/pyspy_modes.py and
docs/stacks.md.

``collect()`` only folds finished windows into counters and returns a snapshot: no
py-spy run happens on a scrape. Whether a rank stands still is ``stall.py``, how fast
each process is looked at ``pace.py``, and the ring of folded stacks per rank that feeds
``/api/stacks`` ``ring.py``; native windows (asked here) feed the collective waits.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

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
    TopK,
    classify,
    classify_with_idle,
    dominant_stack,
    remember_idle_places,
)
from profagent.config import StacksConfig
from profagent.contracts import (
    ROLE_DATALOADER,
    ROLE_MAIN,
    Frame,
    ProcessTree,
    StackGroup,
    StacksSnapshot,
)
from profagent.errors import SourceUnavailable
from profagent.logs import LogOnce
from profagent.sources.stacks import pyspy
from profagent.sources.stacks.pace import PacePolicy
from profagent.sources.stacks.ring import StackRing
from profagent.sources.stacks.sampler import Result, Sampler
from profagent.sources.stacks.stall import NativeLook, StallPolicy

log = logging.getLogger(__name__)

JOB_MEMORY_SECONDS = 60.0  # how long a pid's job is remembered after it left the targets

# (rank, job_id) -> whether the rank works by a signal other than its stacks (its GPUs, its
# steps); None: unknown. True holds off a stall however still its stack stands.
RankBusy = Callable[[str, str], "bool | None"]
JobHot = Callable[[str], bool]  # job_id -> a finding is active on the job



class StacksSource:
    name = "stacks"

    def __init__(
        self,
        config: StacksConfig,
        interval: float = 1.0,
        busy: RankBusy | None = None,
        binary: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        proc_root: str = "/proc",
    ) -> None:
        self.config = config
        self.interval = interval
        self.busy = busy
        self.job_hot: JobHot | None = None  # set by the engine: full rate while the job has a finding
        self._pace_policy = PacePolicy()
        self._binary = binary
        self._clock, self._wall = clock, wall
        self._proc_root = proc_root
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
        self._stall = StallPolicy()
        # collective waits, per (job_id, rank): see analysis/collectives.WaitRatios
        self._ratios: dict[tuple[str, str], WaitRatios] = {}
        self._judged: dict[tuple[str, str], tuple[int, float]] = {}  # cumulative (samples, waits)
        self._last_native: dict[tuple[str, str], float] = {}  # clock of the last native request
        self._native_pending: dict[tuple[str, str], tuple[int, float]] = {}  # -> (pid, asked at)
        self._native_stack: dict[tuple[str, str], NativeLook] = {}  # the last native window's main stack
        self._steady: dict[tuple[str, str], bool] = {}  # the rank's last window was steady
        self._mains: dict[tuple[str, str], int] = {}  # (job_id, rank) -> pid of its main process
        self._errors: dict[tuple[str, str], int] = {}  # (job_id, reason) -> failed py-spy runs
        self._log_once = LogOnce(log)
        self._ring = StackRing()  # read by HTTP threads

    @property
    def _stall_state(self) -> dict[tuple[str, str], tuple[bool, float, tuple[Frame, ...]]]:
        """Each rank's stall state (stall.py), as the pace and native requests read it."""
        return self._stall.state

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Find py-spy and start the sampler thread. Raises SourceUnavailable."""
        self._binary = self._binary or pyspy.find_pyspy()  # raises PySpyProblem, a SourceUnavailable
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
        expired = tree.expired_ranks  # ranks that exited a while ago, in jobs that run on
        for table in (self._categories, self._topk, self._threads, self._idle_places, self._ratios, self._judged,
                      self._last_native, self._native_stack, self._steady, self._native_pending):
            for key in [k for k in table if k[0] not in live or (k[0], k[1]) in expired]:
                del table[key]
        self._stall.forget(live, expired)
        # errors of no job ("": the sampler itself failed) are the agent's: they stay
        for key in [k for k in self._errors if k[0] and k[0] not in live]:
            del self._errors[key]
        self._ring.forget(live, expired)

    def _targets(self, tree: ProcessTree) -> dict[int, tuple[str, str]]:
        roles = (ROLE_MAIN, ROLE_DATALOADER) if self.config.dataloader else (ROLE_MAIN,)
        wanted = {p.pid: (p.rank, p.role) for p in tree.processes if p.role in roles}
        wanted.update(self._stall.workers_to_sample(tree.processes))
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
        self._pace_policy.watched(self._clock())

    def _pace(self, wanted: dict[int, tuple[str, str]]) -> dict[int, tuple[int, float]]:
        """Each process' next windows (pace.py); a stall is suspected in a job when one of
        its ranks' last window had one unchanged stack."""
        suspects = self._stall.suspects()
        return self._pace_policy.pace(self.config, list(wanted), self._job, suspects, self._hot, self._clock())

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
            self._stall.check_worker(group[:2], r.pid, main, r.start, r.end, self.config.stall_seconds)
        if r.role == ROLE_MAIN:
            self._count_waits(group[:2], main, native_main if r.native else None, r.start)
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
        busy = None
        if self.busy is not None:
            try:
                busy = self.busy(r.rank, job)
            except Exception:  # the hook is someone else's: never let it break stacks
                busy = None
        self._stall.check_rank((job, r.rank), main, r.start, r.end, busy, self.config.stall_seconds)

    def _count_waits(self, key: tuple[str, str], main: list[Sample], native_main: list[Sample] | None,
                     start: float) -> None:
        """Judged samples and collective waits of one main-thread window (see docs/stacks.md)."""
        ratios = self._ratios.setdefault(key, WaitRatios())
        if native_main is not None:
            self._native_pending.pop(key, None)
            if not _steady(main):
                log.debug("stacks: rank %s: native window during start-up, not learned", key[1])
                # a window of start-up (imports) teaches nothing about the rank's waits; the
                # next steady window asks again rather than native_every_seconds later
                if not ratios.learned:
                    self._last_native.pop(key, None)
                return
            ratios.learn(native_main)
            log.debug("stacks: rank %s: native window learned %d stacks", key[1], len(native_main))
            waits = float(native_waits(native_main))
            if native_main:
                top = dominant_stack(native_main)
                self._native_stack[key] = NativeLook(python_frames(top), top, moving(native_main, top),
                                                     self._clock(), start)
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
        stall = self._stall.state.get(key)
        look = self._native_stack.get(key)
        # a stack standing still: look at its native frames, and again every half stall_seconds
        # (a rank computing for long in one C++ call may stop there later; a look from before
        # the stack stood still is not where it stands, yet asking again at once would cost a
        # native window per step of a job whose backward stands still for windows each step)
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
        prefix = "" if r.role == ROLE_MAIN else f"{r.role} worker;"
        self._ring.add((self._job(r.pid), r.rank), r.wall_end, r.samples, self.config.ring_seconds, prefix)

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
        stalls = self._stall.rank_stalls(self.config, self._native_stack, set(self._native_pending), self._clock())
        errors = tuple((job, reason, n) for (job, reason), n in sorted(self._errors.items()))
        return StacksSnapshot(job_id, tuple(groups), stalls, errors)

    # -- read by /api/stacks (exporters/api/stacks.py) ---------------------------------------
    def ranks(self) -> list[tuple[str, str]]:
        """(job_id, rank) pairs with stacks in the ring."""
        return self._ring.ranks()

    def folded(self, rank: str, seconds: float, job_id: str | None = None) -> str:
        """Collapsed stacks of ``rank`` over the last ``seconds`` (one ``stack count`` a line)."""
        return self._ring.folded(rank, self._wall() - seconds, job_id)

    @property
    def ring_seconds(self) -> float:
        """How many seconds of stacks the ring keeps: the most /api/stacks gives."""
        return self.config.ring_seconds


def _steady(main: list[Sample]) -> bool:
    """A window of a rank past its start-up: no import, no torch.compile compiling."""
    return bool(main) and not any(
        classify(s.frames) == "compile" or any(f.file.startswith("<frozen importlib") for f in s.frames) for s in main)


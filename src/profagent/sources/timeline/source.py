"""The timeline source: every rank's steps, stages and collective arrivals, from uprobes
on the libtorch each rank has mapped (no trace, no code change, any CPython).

Flow: ``collect`` finds each rank's libtorch (``/proc/PID/maps``), resolves the probed
functions once per library file (``system.elfsyms``), defines the events in tracefs
(``system.uprobes``) and opens them on every CPU (``system.perfevents``). A reader
thread drains the rings into one ``RankTimeline`` per rank process; ``collect``
publishes their figures and matches the job's collectives across ranks.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from profagent.analysis import timeline as tl
from profagent.analysis.timeline_picture import history_of, recent_pictured
from profagent.config import TimelineConfig
from profagent.contracts import (
    ArrivalStraggler,
    ProbedLibrary,
    ProcessTree,
    RankSteps,
    TimelineHistory,
    TimelineSnapshot,
)
from profagent.errors import SourceUnavailable
from profagent.sources.timeline.probes import LIBRARY_NAMES, PROBES, ProbeSpec, probe_offset
from profagent.system import elfsyms, perfevents, uprobes
from profagent.system.cputime import CPU

log = logging.getLogger(__name__)

CAP_SYS_ADMIN, CAP_PERFMON, CAP_CHECKPOINT_RESTORE = 21, 38, 40
MAPS_MAX = 4 << 20  # bytes of /proc/PID/maps read (a process with 100k mappings is cut)
RECHECK_AFTER = 5.0  # seconds before a rank without libtorch is looked at again
SWEEP_EVERY = 60.0  # seconds between two looks for definitions a dead agent left
ARRIVALS_KEPT = 4096  # matched collectives kept per job for the straggler window
STRAGGLER_EVERY = 2.0  # seconds between two summaries of a job's arrivals
RECORD_NAMES_KEPT = 1024  # record_function name heads whose kind is remembered


@dataclass
class _Rank:
    job_id: str
    rank: str
    timeline: tl.RankTimeline = field(default_factory=tl.RankTimeline)
    lag_buckets: list[int] = field(default_factory=lambda: [0] * len(tl.LAG_BUCKETS))
    lag_sum: float = 0.0
    lag_count: int = 0


def capability_problem() -> str:
    """Why this process cannot place probes ("" when it can): CAP_PERFMON for events on
    every CPU, CAP_CHECKPOINT_RESTORE for /proc/PID/map_files (CAP_SYS_ADMIN grants both),
    and root's own tracefs files."""
    if platform.machine() != "x86_64":
        return f"uprobes are placed only on x86-64 (this is {platform.machine()})"
    why = perfevents.available()
    if why:
        return why
    try:
        with open("/proc/self/status") as fh:
            caps = next((int(line.split()[1], 16) for line in fh if line.startswith("CapEff:")), 0)
    except OSError:
        caps = 0
    admin = bool(caps & (1 << CAP_SYS_ADMIN))
    missing = [name for name, bit in (("CAP_PERFMON", CAP_PERFMON), ("CAP_CHECKPOINT_RESTORE", CAP_CHECKPOINT_RESTORE))
               if not admin and not caps & (1 << bit)]
    if missing:
        return f"needs {' and '.join(missing)} (root, or the systemd unit / DaemonSet of deploy/)"
    if os.geteuid() != 0:
        return "needs root's uid to define uprobes in tracefs (root, or the systemd unit / DaemonSet of deploy/)"
    return ""


class TimelineSource:
    name = "timeline"

    def __init__(self, config: TimelineConfig, interval: float, proc_root: Path = Path("/proc"),
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.config = config
        self.interval = interval
        self.proc_root = proc_root
        self.clock = clock
        self.wall = wall
        self.note = ""
        self._tracefs: Path | None = None
        self._group = ""
        self._reader: perfevents.TracepointReader | None = None
        self._lock = threading.Lock()
        self._kinds: dict[int, str] = {}  # tracepoint id -> what its hits are (tl.RECORD: read the name)
        self._record_kinds: dict[bytes, str] = {}  # a record_function name's head -> its kind
        self._defined: dict[int, str] = {}  # tracepoint id -> its event name in our group
        self._libraries: dict[tuple[int, int], ProbedLibrary | None] = {}  # (dev, inode) -> placed
        self._ranks: dict[int, _Rank] = {}  # pid -> its running figures
        self._looked: dict[int, float] = {}  # pid -> when its maps were last read without libtorch
        self._arrivals: dict[str, deque[tl.Arrival]] = {}
        self._matched_until: dict[str, float] = {}
        self._straggler_at: dict[str, tuple[float, ArrivalStraggler | None]] = {}  # job -> (when, summary)
        self._counts = [0, 0]  # events, foreign events
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._swept = clock()

    # -- lifecycle --------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """Started and not stopped: reading the probes' events."""
        return self._reader is not None

    @property
    def probing(self) -> bool:
        """Some probe placed (in the library of some rank)."""
        return bool(self._defined)

    def start(self) -> None:
        problem = capability_problem()
        if problem:
            raise SourceUnavailable(f"timeline: {problem}", fix="run profagent as root (see docs/timeline.md)")
        tracefs = uprobes.find_tracefs(mount_if_missing=True)
        if tracefs is None:
            raise SourceUnavailable("timeline: tracefs is not mounted",
                                    fix="mount -t tracefs nodev /sys/kernel/tracing")
        self._tracefs = tracefs
        stale = uprobes.remove_stale(tracefs)
        if stale:
            log.info("timeline: removed %d probe definitions left by an agent that died", stale)
        self._group = uprobes.new_group()
        self._reader = perfevents.TracepointReader(pages=self.config.ring_pages)
        self._thread = threading.Thread(target=self._read_loop, name="profagent-timeline", daemon=True)
        self._thread.start()

    def stop(self, budget: float = 1.0) -> None:
        """Stop reading now, then close the fds and remove our definitions, for at most
        ``budget`` seconds (the kernel takes 0.1 s or more to disarm each probe); what is
        left is finished by a daemon thread, or by the kernel at our exit, and a
        definition left over is removed by the next agent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
        with self._lock:
            reader, self._reader = self._reader, None
        tracefs, group, names = self._tracefs, self._group, dict(self._defined)
        if reader is None or tracefs is None:
            return

        def release() -> None:
            reader.close(each=lambda tp: uprobes.remove(tracefs, group, names[tp]) if tp in names else None)

        releaser = threading.Thread(target=release, name="profagent-timeline-release", daemon=True)
        releaser.start()
        releaser.join(budget)

    # -- reading ----------------------------------------------------------------------
    def _read_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                reader = self._reader
                has_rings = reader is not None and bool(reader.rings)
            if not has_rings:
                self._stop.wait(0.1)
                continue
            assert reader is not None
            try:
                with CPU.charge(self.name):  # the wait in poll costs no CPU
                    samples = reader.read(0.1, lock=self._lock)
            except (OSError, ValueError) as exc:  # a ring closed under us at stop
                if not self._stop.is_set():
                    log.warning("timeline: reading probe events failed: %s", exc)
                self._stop.wait(0.1)
                continue
            if samples:
                with CPU.charge(self.name), self._lock:
                    self._fold(samples)

    def _fold(self, samples: list[perfevents.Sample]) -> None:
        # Every probe hit of every rank passes here (thousands a second at 8 ranks): the
        # loop does no more than look up the rank and the event, and feed it.
        ranks, kinds, heads = self._ranks, self._kinds, self._record_kinds
        events = foreign = 0
        for time_ns, pid, tid, event, raw in samples:
            kind = kinds.get(event)
            rank = ranks.get(pid)
            if kind is None or rank is None:
                foreign += 1
                continue
            events += 1
            if kind == tl.RECORD:
                head = raw[16:32]  # the first 16 bytes of the block's name
                kind = heads.get(head)
                if kind is None:
                    kind = tl.record_kind(head)
                    if len(heads) < RECORD_NAMES_KEPT:  # names are the job's: any number may come
                        heads[head] = kind
            rank.timeline.feed(kind, tid, time_ns / 1e9)
        self._counts[0] += events
        self._counts[1] += foreign

    # -- probing ----------------------------------------------------------------------
    def _probe_process(self, pid: int, now: float) -> None:
        """Probe the libtorch the process has mapped, once per library file."""
        if now - self._looked.get(pid, -RECHECK_AFTER) < RECHECK_AFTER:
            return
        self._looked[pid] = now
        for key, path, mapping in _libraries(self.proc_root, pid):
            if key in self._libraries:
                continue
            if len(self._libraries) >= self.config.max_libraries:
                log.warning("timeline: %d libraries probed already (timeline.max_libraries): %s skipped",
                            len(self._libraries), path)
                self._libraries[key] = None
                continue
            self._libraries[key] = self._probe_library(pid, key, path, mapping)

    def _probe_library(self, pid: int, key: tuple[int, int], path: str, mapping: str) -> ProbedLibrary | None:
        target = f"{self.proc_root}/{pid}/map_files/{mapping}"
        try:
            fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            log.info("timeline: cannot open %s of PID %d: %s", path, pid, exc.strerror)
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_ino != key[1]:
                log.warning("timeline: %s of PID %d is not the regular file it mapped: not probed", path, pid)
                return None
            with os.fdopen(os.dup(fd), "rb") as fh:
                library = elfsyms.read_functions(fh, {spec.key: spec.pattern for spec in PROBES})
        except elfsyms.ElfError as exc:
            log.warning("timeline: %s of PID %d: %s: not probed", path, pid, exc)
            return None
        finally:
            os.close(fd)
        return self._place(len(self._libraries), target, path, library)

    def _place(self, index: int, target: str, path: str, library: elfsyms.Library) -> ProbedLibrary | None:
        if library.machine != "EM_X86_64":
            return ProbedLibrary(path, library.build_id, (), (f"all: machine {library.machine}",))
        placed: list[tuple[ProbeSpec, int]] = []
        refused: list[str] = []
        for spec in PROBES:
            functions = library.functions.get(spec.key, ())
            if not functions:
                continue
            for function in functions[:1]:  # one overload: the names are torch's own
                offset = probe_offset(function.code, spec.kind)
                if offset is None:
                    refused.append(f"{spec.key}: its first instruction is not one the kernel emulates")
                    continue
                placed.append((spec, function.file_offset + offset))
        if not placed and not refused:
            return ProbedLibrary(path, library.build_id, (), ())  # a library without torch's functions
        names: list[str] = []
        assert self._tracefs is not None and self._reader is not None
        for spec, offset in placed:
            name = f"{spec.key}_{index}"
            try:
                tp = uprobes.define(self._tracefs, self._group, name, target, offset, spec.fetchargs)
                with self._lock:
                    self._reader.add(tp)
                    self._kinds[tp] = spec.kind
            except OSError as exc:
                uprobes.remove(self._tracefs, self._group, name)
                refused.append(f"{spec.key}: {exc.strerror or exc}")
                continue
            self._defined[tp] = name
            names.append(spec.key)
        log.info("timeline: probing %s (%d probes%s)", path, len(names),
                 f"; not placed: {'; '.join(refused)}" if refused else "")
        return ProbedLibrary(path, library.build_id, tuple(names), tuple(refused))

    # -- collecting -------------------------------------------------------------------
    def collect(self, tree: ProcessTree) -> TimelineSnapshot:
        now = self.clock()
        if self._tracefs is not None and now - self._swept >= SWEEP_EVERY:
            # an agent killed just before we started held its events open a moment longer
            self._swept = now
            uprobes.remove_stale(self._tracefs, keep=self._group)
        mains = {p.pid: p for p in tree.mains()}
        for pid, info in mains.items():
            job = info.job_id or tree.job_id
            with self._lock:
                known = self._ranks.get(pid)
                if known is None or (known.job_id, known.rank) != (job, info.rank):
                    self._ranks[pid] = _Rank(job, info.rank, known.timeline if known else tl.RankTimeline(
                        history=deque(maxlen=self.config.history_steps)))
            self._probe_process(pid, now)
        with self._lock:
            for pid in [p for p in self._ranks if p not in mains]:
                del self._ranks[pid]
                self._looked.pop(pid, None)
            self._match(now)
            ranks = tuple(self._rank_steps(pid, r, now) for pid, r in sorted(self._ranks.items()))
            stragglers = self._stragglers(now)
            counts = tuple(self._counts)
            lost = self._reader.lost[0] if self._reader is not None else 0
        libraries = tuple(lib for lib in self._libraries.values() if lib is not None and (lib.probes or lib.refused))
        return TimelineSnapshot(ranks, stragglers, libraries, counts[0], lost, counts[1], self.config.window_seconds)

    def history(self, seconds: float, node: str = "", ranks: Collection[str] = (), job: str | None = None) -> TimelineHistory:
        """The steps of the last ``seconds`` of every rank (or of ``ranks``, of ``job``) and
        the step each is in now, for the picture; times on the probes' clock, with the
        offset that makes them Unix time."""
        now = self.clock()
        offset = self.wall() - now
        since = now - seconds
        taken = []
        with self._lock:  # a copy of references only: the reader waits on this lock
            for pid, r in sorted(self._ranks.items()):
                if (ranks and r.rank not in ranks) or (job is not None and r.job_id != job):
                    continue
                t = r.timeline
                taken.append((recent_pictured(t, since), t.in_progress(), t.steps_total, t.last_event, r.job_id, r.rank, pid))
        return TimelineHistory(node, now, offset, tuple(
            history_of(pictured, now_in, total, last, job_id, rank, pid, node, now)
            for pictured, now_in, total, last, job_id, rank, pid in taken))

    def _match(self, now: float) -> None:
        """Match the collectives of each job's newly completed steps across its ranks."""
        jobs: dict[str, dict[str, tl.RankTimeline]] = {}
        owners: dict[tuple[str, str], _Rank] = {}
        for r in self._ranks.values():
            jobs.setdefault(r.job_id, {})[r.rank] = r.timeline
            owners[(r.job_id, r.rank)] = r
        for job, timelines in jobs.items():
            if len(timelines) < 2:
                continue
            steps = {rank: list(t.recent) for rank, t in timelines.items()}
            arrivals, until = tl.match_arrivals(steps, self._matched_until.get(job, float("-inf")))
            self._matched_until[job] = until
            kept = self._arrivals.setdefault(job, deque(maxlen=ARRIVALS_KEPT))
            for arrival in arrivals:
                kept.append(arrival)
                for rank, lag in arrival.lags().items():
                    owner = owners[(job, rank)]
                    owner.lag_sum += lag
                    owner.lag_count += 1
                    index = _bucket(tl.LAG_BUCKETS, lag)
                    if index is not None:
                        owner.lag_buckets[index] += 1
        for job in [j for j in self._arrivals if j not in jobs]:
            del self._arrivals[job]
            self._matched_until.pop(job, None)

    def _stragglers(self, now: float) -> tuple[ArrivalStraggler, ...]:
        """Each job's arrival straggler over the window, recomputed at most every
        STRAGGLER_EVERY seconds: the summary reads every matched collective of the window
        (thousands), and the finding it feeds needs the window, not the last tick."""
        out = []
        for job, arrivals in sorted(self._arrivals.items()):
            cached = self._straggler_at.get(job)
            if cached is None or now - cached[0] >= STRAGGLER_EVERY:
                cached = self._straggler_at[job] = (now, self._job_straggler(job, arrivals, now))
            if cached[1] is not None:
                out.append(cached[1])
        for job in [j for j in self._straggler_at if j not in self._arrivals]:
            del self._straggler_at[job]
        return tuple(out)

    def _job_straggler(self, job: str, arrivals: deque[tl.Arrival], now: float) -> ArrivalStraggler | None:
        since = now - self.config.window_seconds
        recent = [a for a in arrivals if a.step_start >= since]
        if not recent:
            return None
        steps = [s.seconds for r in self._ranks.values() if r.job_id == job
                 for s in tl.window(r.timeline.recent, since)]
        summary = tl.last_arrivals(recent, tl.quantile(steps, 0.5) if steps else 0.0)
        if not summary.last_counts:
            return None
        rank, count = max(summary.last_counts.items(), key=lambda kv: (kv[1], kv[0]))
        span = max(max(a.times.values()) for a in recent) - min(min(a.times.values()) for a in recent)
        return ArrivalStraggler(job, rank, count / summary.collectives, summary.median_lag.get(rank, 0.0),
                                summary.step_lag.get(rank, 0.0),
                                tl.quantile([v for r, v in summary.step_lag.items() if r != rank] or [0.0], 0.5),
                                summary.step_seconds, summary.collectives, span)

    def _rank_steps(self, pid: int, r: _Rank, now: float) -> RankSteps:
        t = r.timeline
        recent = tl.window(t.recent, now - self.config.window_seconds)
        seconds = [s.seconds for s in recent]
        span = (recent[-1].start + recent[-1].seconds - recent[0].start) if recent else 0.0
        return RankSteps(
            r.job_id, r.rank, pid, t.optimizer_steps, t.steps_total, t.step_seconds_sum, tuple(t.step_buckets), dict(t.stage_seconds),
            t.backwards_total, t.collectives_total, len(recent),
            tl.quantile(seconds, 0.5) if seconds else None, tl.quantile(seconds, 0.9) if seconds else None,
            max(seconds) if seconds else None, len(recent) / span if span > 0 else None,
            sum(s.backwards for s in recent) / len(recent) if recent else None,
            _shares(recent),
            t.stage_now, now - t.last_event if t.last_event is not None else None,
            now - t.last_step if t.last_step is not None else None,
            tuple(r.lag_buckets), r.lag_sum, r.lag_count, len(t.arrivals_in_step))


def _shares(steps: list[tl.Step]) -> dict[str, float]:
    total = sum(s.seconds for s in steps)
    if total <= 0:
        return {}
    return {stage: sum(s.stages.get(stage, 0.0) for s in steps) / total for stage in tl.STAGES}


def _bucket(bounds: tuple[float, ...], value: float) -> int | None:
    for i, bound in enumerate(bounds):
        if value <= bound:
            return i
    return None


_MAPS_LINE = re.compile(rb"^([0-9a-f]+-[0-9a-f]+) (\S{4}) [0-9a-f]+ ([0-9a-f]+):([0-9a-f]+) (\d+) +(/.*)$", re.M)


def _libraries(proc_root: Path, pid: int) -> list[tuple[tuple[int, int], str, str]]:
    """((dev, inode), path, map_files name) of each executable mapping of a libtorch."""
    try:
        with open(f"{proc_root}/{pid}/maps", "rb") as fh:
            text = fh.read(MAPS_MAX)
    except OSError:
        return []
    out = []
    seen: set[tuple[int, int]] = set()
    for m in _MAPS_LINE.finditer(text):
        span, perms, major, minor, inode, path = m.groups()
        name = path.decode("utf-8", "replace")
        if b"x" not in perms or not LIBRARY_NAMES.search(name.removesuffix(" (deleted)")):
            continue
        key = (os.makedev(int(major, 16), int(minor, 16)), int(inode))
        if key not in seen:
            seen.add(key)
            out.append((key, name[:200], span.decode()))
    return out

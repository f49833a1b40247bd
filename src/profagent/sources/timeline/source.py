"""The timeline source: every rank's steps, stages and collective arrivals, from uprobes
on the libtorch each rank has mapped (no trace, no code change, any CPython).

Flow: ``collect`` finds each rank's libtorch (``/proc/PID/maps``); a worker thread
resolves the probed functions once per library file (``system.elfsyms``), users in turn;
``collect`` then defines the events in tracefs (``system.uprobes``), opens them on every
CPU (``system.perfevents``), and removes those of a file no rank maps any more. A reader
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
from collections import OrderedDict, deque
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
# ... and one whose every libtorch is probed (or gave no probe: libtorch.so's shim), for a
# library it maps later: reading a torch process's maps takes milliseconds, every rank
RECHECK_PROBED = 60.0
SWEEP_EVERY = 60.0  # seconds between two looks for definitions a dead agent left
# A job's matched collectives are kept folded a step each (tl.StepArrivals: a few numbers a
# rank), for timeline.window_seconds, so the window holds whatever the collectives a step;
# at most this many steps a job (60 s of 4 ms steps; about 10 MB at 8 ranks).
STEPS_KEPT = 16384
STRAGGLER_EVERY = 2.0  # seconds between two summaries of a job's arrivals
RECORD_NAMES_KEPT = 1024  # record_function name heads whose kind is remembered
LOSS_ACTIVE = 2.0  # seconds since a rank's last event within which a loss nobody claims may be its
PARSE_SECONDS = 20.0  # for one library's symbols (libtorch_cpu.so: 0.4 s), then it is refused
FAILED_KEPT = 1024  # files that gave no probe, remembered so as not to read them again
QUEUED_PER_USER = 16  # files of one user waiting to be read
UNMAPPED_GRACE = 10.0  # seconds a placed library is mapped by no observed process before its probes go
# The reader wakes when a ring is a quarter full, else after this long; each collect reads
# the rings first, so the figures are as fresh as the collect: a 10 Hz wake-up over every
# CPU's ring cost more than the few hundred events a second it read.
READ_EVERY = 1.0
RELEASE_SECONDS = 6.0  # a clean stop's time for removing our probes: under systemd's TimeoutStopSec=10

# A process over timeline.flood_events a second is shed for SHED_SECONDS at a time: the
# kernel's rings are per CPU, shared by every process, so one that floods them (thread
# churn opening blocks it never closes) would slow the reading of every job's events until
# the rings overflow. Shed events are dropped as an array, unread.
SHED_SECONDS = 10.0
JUDGE_EVERY = 0.25  # seconds of counts a process's rate is judged on


@dataclass(frozen=True)
class _File:
    """A mapped library file to read: found through ``pid``'s map_files entry."""

    key: tuple[int, int]  # (dev, inode)
    identity: tuple[int, int, int, int]  # (dev, inode, mtime ns, size): a failure is remembered by it
    uid: int  # whose process mapped it: the user charged for its slot
    pid: int
    path: str
    target: str  # /proc/PID/map_files/RANGE


@dataclass
class _Placed:
    uid: int
    library: ProbedLibrary
    events: dict[int, str]  # tracepoint id -> its event name in our group


@dataclass
class _Rank:
    job_id: str
    rank: str
    timeline: tl.RankTimeline = field(default_factory=tl.RankTimeline)
    window: tl.StepWindow = field(default_factory=tl.StepWindow)  # its steps of timeline.window_seconds
    lag_buckets: list[int] = field(default_factory=lambda: [0] * len(tl.LAG_BUCKETS))
    lag_sum: float = 0.0
    lag_count: int = 0
    lost_events: int = 0  # events lost on a CPU where it ran (see _attribute_losses)
    lost_said: bool = False


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
        self._placed: dict[tuple[int, int], _Placed] = {}  # (dev, inode) -> its probes
        self._queued: dict[tuple[int, int], _File] = {}  # waiting to be read, or being read
        self._per_user: dict[int, deque[_File]] = {}  # uid -> its files waiting, read in turn across users
        self._read: deque[tuple[_File, elfsyms.Library | str]] = deque()  # what the worker read, or why not
        self._failed: OrderedDict[tuple[int, int, int, int], ProbedLibrary | None] = OrderedDict()
        self._mapped_by: dict[int, frozenset[tuple[int, int]]] = {}  # pid -> the libraries it maps
        self._unmapped_since: dict[tuple[int, int], float] = {}  # placed, mapped by no observed process since
        self._full_said: set[int] = set()  # users told their slots are full
        self._serial = 0  # appended to event names: each placement's own
        self._turn = 0  # whose file the worker reads next
        self._releasing: dict[int, str] = {}  # the release the worker is doing
        self._files_lock = threading.Lock()  # guards _per_user and _read (the worker's side)
        self._work = threading.Event()
        self._worker: threading.Thread | None = None
        self._releases: deque[dict[int, str]] = deque()  # events of libraries no longer mapped
        self._ranks: dict[int, _Rank] = {}  # pid -> its running figures
        self._looked: dict[int, float] = {}  # pid -> when its maps are read again
        self._arrivals: dict[str, tl.ArrivalWindow] = {}  # job -> its matched steps of the window
        self._matched_until: dict[str, float] = {}
        self._straggler_at: dict[str, tuple[float, ArrivalStraggler | None]] = {}  # job -> (when, summary)
        self._counts = [0, 0]  # events, foreign events
        self._shed: dict[int, float] = {}  # pid -> until when its events are shed
        self._shed_events: dict[int, int] = {}  # pid -> its events shed (a rank's, reported)
        self._counted_at = clock()
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
        self._worker = threading.Thread(target=self._file_loop, name="profagent-timeline-files", daemon=True)
        self._worker.start()

    def stop(self, budget: float = 1.0) -> None:
        """Stop reading, close every event and remove our definitions. The kernel takes
        about 0.08 s to disarm each probe (more on a busy node), so this goes on in a
        thread, begun at once, that the interpreter waits for at exit, for at most
        RELEASE_SECONDS; ``budget`` is how long this call waits for it. A definition left
        over is removed by the next agent (``uprobes.remove_stale``)."""
        self._stop.set()
        self._work.set()
        with self._lock:
            reader, self._reader = self._reader, None
        if reader is not None:
            reader.wake()
        tracefs, group, reading = self._tracefs, self._group, self._thread
        if reader is None or tracefs is None:
            return
        names = {**self._defined, **self._releasing}
        while self._releases:  # a release the worker had not begun
            names.update(self._releases.popleft())

        def release() -> None:
            began = time.monotonic()
            deadline = began + RELEASE_SECONDS
            for tp in list(reader.fds):  # the slow part: each event's last close disarms its probe
                if time.monotonic() > deadline:
                    break
                reader.remove(tp)
            if reading is not None:
                reading.join(1.0)  # its rings go next
            reader.close()  # what the deadline left is disarmed by the kernel at our exit
            removed = sum(1 for name in names.values() if uprobes.remove(tracefs, group, name))
            taken = time.monotonic() - began
            if removed < len(names):
                log.warning("timeline: removed %d of %d probe definitions in %.1f s; the next agent removes "
                            "the rest", removed, len(names), taken)
            else:
                log.info("timeline: removed our %d probe definitions in %.1f s", removed, taken)

        # not a daemon (not inherited from the stopping thread, which is one): the
        # process's exit waits for it, and its deadline bounds the wait
        releaser = threading.Thread(target=release, name="profagent-timeline-release", daemon=False)
        releaser.start()
        releaser.join(budget)
        if self._worker is not None:
            self._worker.join(0.1)  # a daemon: a read it is in has its own deadline

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
                    reader.wait(READ_EVERY, lock=self._lock)
                    if not self._stop.is_set():
                        self._drain()
                        self._judge_floods(reader)
            except (OSError, ValueError) as exc:  # a ring closed under us at stop
                if not self._stop.is_set():
                    log.warning("timeline: reading probe events failed: %s", exc)
                self._stop.wait(0.1)

    def _drain(self) -> None:
        """Fold what the rings hold: by the reader, and by each collect before its figures.
        Read and folded under one hold of the lock, so events are fed in order."""
        with self._lock:
            reader = self._reader
            if reader is None:
                return
            samples = reader.drain(frozenset(self._shed))
            if samples or reader.losses:
                self._fold(samples)
                self._attribute_losses(reader)

    def _judge_floods(self, reader: perfevents.TracepointReader) -> None:
        """Every JUDGE_EVERY seconds: shed the events of each process that sent over
        timeline.flood_events a second, for SHED_SECONDS (judged again then). A quarter of
        a second of a flood read in full is what the rings must hold."""
        now = self.clock()
        elapsed = now - self._counted_at
        if elapsed < JUDGE_EVERY:
            return
        with self._lock:
            counts, reader.counts = reader.counts, {}
            self._counted_at = now
            for pid, n in counts.items():
                if pid in self._shed and pid in self._ranks:
                    self._shed_events[pid] = self._shed_events.get(pid, 0) + n
                if n / elapsed > self.config.flood_events:
                    if pid not in self._shed:
                        log.warning("timeline: PID %d sent %d probe events a second (over %d, timeline.flood_events): "
                                    "its events are shed for %.0f s, so that other jobs' are read in time", pid,
                                    n / elapsed, self.config.flood_events, SHED_SECONDS)
                    self._shed[pid] = now + SHED_SECONDS
            for pid in [p for p, until in self._shed.items() if until <= now]:
                del self._shed[pid]

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

    def _attribute_losses(self, reader: perfevents.TracepointReader) -> None:
        """Charge each ring's lost events to the observed ranks whose samples that ring
        held in the same read (they ran there as the events were dropped); when it held
        none of theirs, to every rank with an event in the last LOSS_ACTIVE seconds (one
        whose events were all lost), never to an idle one: another process's flood says
        nothing of a rank that was not running."""
        losses, reader.losses = reader.losses, []
        if not losses:
            return
        now = self.clock()
        active = [r for r in self._ranks.values()
                  if r.timeline.last_event is not None and now - r.timeline.last_event < LOSS_ACTIVE]
        for count, pids in losses:
            ranks = [r for pid, r in self._ranks.items() if pid in pids] or active
            for rank in ranks:
                rank.lost_events += count

    # -- probing ---------------------------------------------------------------------
    # Each user has timeline.max_libraries slots: a library placed costs one slot of the
    # user whose process it was found through, until no observed process maps it; a file
    # that gives no probe costs none, and is remembered (bounded) so as not to be read
    # again. Files are read by a worker, round robin across users, with a deadline: a
    # hostile file never holds up the figures of the jobs already probed.
    def _probe_process(self, pid: int, now: float) -> None:
        """Queue the libtorch files the process maps that are not probed yet."""
        if now < self._looked.get(pid, now):
            return
        found = _libraries(self.proc_root, pid)
        if found is None:  # gone, or unreadable for now: what it mapped stands
            self._looked[pid] = now + RECHECK_AFTER
            return
        gave_none = {(dev, inode) for dev, inode, _, _ in self._failed} if found else set()
        probed = bool(found) and all(key in self._placed or key in gave_none for key, _, _ in found)
        self._looked[pid] = now + (RECHECK_PROBED if probed else RECHECK_AFTER)
        self._mapped_by[pid] = frozenset(key for key, _, _ in found)
        try:
            uid = os.stat(f"{self.proc_root}/{pid}").st_uid
        except OSError:
            return
        for key, path, mapping in found:
            if key in self._placed or key in self._queued:
                continue
            target = f"{self.proc_root}/{pid}/map_files/{mapping}"
            try:
                st = os.stat(target)
            except OSError as exc:
                log.info("timeline: cannot open %s of PID %d: %s", path, pid, exc.strerror)
                continue
            identity = (key[0], key[1], st.st_mtime_ns, st.st_size)
            if identity in self._failed:
                continue
            file = _File(key, identity, uid, pid, path, target)
            if not stat.S_ISREG(st.st_mode) or st.st_ino != key[1]:
                self._fail(file, f"{path} of PID {pid} is not the regular file it mapped: not probed")
                continue
            used = sum(1 for p in self._placed.values() if p.uid == uid) + \
                sum(1 for f in self._queued.values() if f.uid == uid)
            if used >= self.config.max_libraries:
                if uid not in self._full_said:
                    self._full_said.add(uid)
                    log.warning("timeline: uid %d has %d libraries probed or waiting (timeline.max_libraries): "
                                "%s skipped until one is no longer mapped", uid, used, path)
                continue
            with self._files_lock:
                waiting = self._per_user.setdefault(uid, deque())
                if len(waiting) >= QUEUED_PER_USER:
                    continue
                waiting.append(file)
            self._queued[key] = file
            self._work.set()

    def _fail(self, file: _File, why: str, library: ProbedLibrary | None = None) -> None:
        if why:
            log.warning("timeline: %s", why)
        self._failed[file.identity] = library
        while len(self._failed) > FAILED_KEPT:
            self._failed.popitem(last=False)

    def _file_loop(self) -> None:
        """The worker: releases first (they free probes), then one file at a time, each user's in turn."""
        while not self._stop.is_set():
            self._work.wait(1.0)
            self._work.clear()
            while not self._stop.is_set() and self._work_once():
                pass

    def _work_once(self) -> bool:
        """One release, else one file read (the next user's in turn); False when idle."""
        if self._releases:
            self._releasing = self._releases.popleft()  # stop() removes these too if it comes first
            self._release(self._releasing)
            self._releasing = {}
            return True
        with self._files_lock:
            users = sorted(uid for uid, files in self._per_user.items() if files)
            if not users:
                return False
            uid = users[self._turn % len(users)]
            self._turn += 1
            file = self._per_user[uid].popleft()
        with CPU.charge(self.name):
            result = self._read_file(file)
        with self._files_lock:
            self._read.append((file, result))
        return True

    def _read_file(self, file: _File) -> elfsyms.Library | str:
        """The file's probed functions, or why it gives none."""
        try:
            fd = os.open(file.target, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            return f"cannot open {file.path} of PID {file.pid}: {exc.strerror}"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_ino != file.key[1]:
                return f"{file.path} of PID {file.pid} is not the regular file it mapped: not probed"
            with os.fdopen(os.dup(fd), "rb") as fh:
                return elfsyms.read_functions(fh, {spec.key: spec.pattern for spec in PROBES},
                                              deadline=time.monotonic() + PARSE_SECONDS)
        except elfsyms.ElfError as exc:
            return f"{file.path} of PID {file.pid}: {exc}: not probed"
        finally:
            os.close(fd)

    def _place_read(self) -> None:
        """Place the probes of the files the worker read since the last collect."""
        if self._stop.is_set():
            return
        with self._files_lock:
            done = list(self._read)
            self._read.clear()
        for file, result in done:
            self._queued.pop(file.key, None)
            if isinstance(result, str):
                self._fail(file, result)
                continue
            placed = self._place(file, result)
            if placed is not None and placed.events:
                self._placed[file.key] = placed
            elif placed is None:  # a library without torch's functions (libtorch.so's shim, say): no slot
                log.info("timeline: %s of PID %d has none of the probed functions", file.path, file.pid)
                self._fail(file, "")
            else:  # not x86-64, or every definition refused: no slot
                self._fail(file, "", placed.library)

    def _release_unmapped(self, mains: Collection[int]) -> None:
        """Hand the worker the probes of every library that no observed process maps."""
        for pid in [p for p in self._mapped_by if p not in mains]:
            del self._mapped_by[pid]
        mapped = set().union(*self._mapped_by.values()) if self._mapped_by else set()
        now = self.clock()
        for key in [k for k in self._unmapped_since if k in mapped or k not in self._placed]:
            del self._unmapped_since[key]
        for key in [k for k in self._placed if k not in mapped]:
            if now - self._unmapped_since.setdefault(key, now) < UNMAPPED_GRACE:
                continue  # a rank between two of its looks, or a job about to restart its ranks
            del self._unmapped_since[key]
            placed = self._placed.pop(key)
            self._full_said.discard(placed.uid)
            with self._lock:
                for tp in placed.events:
                    self._kinds.pop(tp, None)
                    self._defined.pop(tp, None)
            log.info("timeline: %s is no longer mapped by an observed process: its %d probes removed",
                     placed.library.path, len(placed.events))
            self._releases.append(placed.events)
            self._work.set()

    def _release(self, events: dict[int, str]) -> None:
        reader, tracefs = self._reader, self._tracefs
        for tp, name in events.items():
            if reader is not None:
                reader.remove(tp)
            if tracefs is not None:
                uprobes.remove(tracefs, self._group, name)

    def _place(self, file: _File, library: elfsyms.Library) -> _Placed | None:
        if self._stop.is_set() or self._reader is None:  # stopping: define nothing more
            return None
        path = file.path
        if library.machine != "EM_X86_64":
            return _Placed(file.uid, ProbedLibrary(path, library.build_id, (), (f"all: machine {library.machine}",)), {})
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
            return None  # a library without torch's functions
        self._serial += 1
        events: dict[int, str] = {}
        assert self._tracefs is not None and self._reader is not None
        for spec, offset in placed:
            name = f"{spec.key}_{self._serial}"
            try:
                tp = uprobes.define(self._tracefs, self._group, name, file.target, offset, spec.fetchargs)
                with self._lock:
                    self._reader.add(tp)
                    self._kinds[tp] = spec.kind
            except OSError as exc:
                uprobes.remove(self._tracefs, self._group, name)
                refused.append(f"{spec.key}: {exc.strerror or exc}")
                continue
            self._defined[tp] = name
            events[tp] = spec.key
        log.info("timeline: probing %s (%d probes%s)", path, len(events),
                 f"; not placed: {'; '.join(refused)}" if refused else "")
        names = tuple(events.values())
        return _Placed(file.uid, ProbedLibrary(path, library.build_id, names, tuple(refused)),
                       {tp: self._defined[tp] for tp in events})

    # -- collecting -------------------------------------------------------------------
    def collect(self, tree: ProcessTree) -> TimelineSnapshot:
        now = self.clock()
        if self._tracefs is not None and now - self._swept >= SWEEP_EVERY:
            # an agent killed just before we started held its events open a moment longer
            self._swept = now
            uprobes.remove_stale(self._tracefs, keep=self._group)
        mains = {p.pid: p for p in tree.mains()}
        try:
            self._drain()  # the events since the reader's last wake-up: the figures are of now
        except (OSError, ValueError) as exc:
            log.warning("timeline: reading probe events failed: %s", exc)
        self._place_read()
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
                self._shed_events.pop(pid, None)
            open_threads = {pid: tids for pid, r in self._ranks.items() if len(tids := r.timeline.open_threads) > 1}
        # threads listed after their blocks were: one missing from the list has exited
        exited = {pid: set(tids) - alive for pid, tids in open_threads.items()
                  if (alive := _threads(self.proc_root, pid)) is not None}
        with self._lock:
            for pid, tids in exited.items():
                if tids and pid in self._ranks:
                    self._ranks[pid].timeline.forget_threads(tids)
            self._match(now)
            ranks = tuple(self._rank_steps(pid, r, now) for pid, r in sorted(self._ranks.items()))
            stragglers = self._stragglers(now)
            newly_lossy = [r for r in self._ranks.values() if r.lost_events and not r.lost_said]
            for r in newly_lossy:
                r.lost_said = True
            counts = tuple(self._counts)
            lost = self._reader.lost[0] if self._reader is not None else 0
        for r in newly_lossy:
            log.warning("timeline: job %s rank %s: %d probe events lost where it ran (ring buffers full; "
                        "timeline.ring_pages): its step figures miss events, its counts are a floor",
                        r.job_id, r.rank, r.lost_events)
        self._release_unmapped(mains)
        mapped = set().union(*self._mapped_by.values()) if self._mapped_by else set()
        unprobed = [lib for (dev, inode, _, _), lib in self._failed.items() if lib is not None and (dev, inode) in mapped]
        libraries = (*(p.library for p in self._placed.values()), *unprobed)
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
            steps = tl.new_steps({rank: t.recent for rank, t in timelines.items()},
                                 self._matched_until.get(job, float("-inf")))
            arrivals, until = tl.match_arrivals(steps, self._matched_until.get(job, float("-inf")))
            self._matched_until[job] = until
            kept = self._arrivals.get(job)
            if kept is None:
                kept = self._arrivals[job] = tl.ArrivalWindow(STEPS_KEPT)
            kept.extend(tl.fold_steps(arrivals))
            kept.expire(now - self.config.window_seconds)
            for arrival in arrivals:
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

    def _job_straggler(self, job: str, arrivals: tl.ArrivalWindow, now: float) -> ArrivalStraggler | None:
        arrivals.expire(now - self.config.window_seconds)
        recent = arrivals.steps
        if not recent:
            return None
        # the ranks' windows: brought up to now by _rank_steps in this collect
        steps = [seconds for r in self._ranks.values() if r.job_id == job for seconds in r.window.ordered]
        summary = arrivals.summary(tl.quantile(steps, 0.5) if steps else 0.0)
        if not summary.step_last_counts and not summary.last_counts:
            return None
        # the rank that lagged most at the most steps (a synchronising collective a step
        # leaves the others a coin toss: see tl.summarize), then the one last most often
        rank = max(summary.step_lag, key=lambda r: (summary.step_last_counts.get(r, 0), summary.last_counts.get(r, 0), r))
        span = max(s.last for s in recent) - min(s.first for s in recent)
        return ArrivalStraggler(job, rank, summary.last_counts.get(rank, 0) / summary.collectives,
                                summary.median_lag.get(rank, 0.0), summary.step_lag.get(rank, 0.0),
                                tl.quantile([v for r, v in summary.step_lag.items() if r != rank] or [0.0], 0.5),
                                summary.step_seconds, summary.collectives, span,
                                summary.step_last_counts.get(rank, 0) / summary.steps, summary.steps,
                                summary.step_max_lag.get(rank, 0.0))

    def _rank_steps(self, pid: int, r: _Rank, now: float) -> RankSteps:
        t, w = r.timeline, r.window
        w.follow(t.recent, t.steps_total)
        w.expire(now - self.config.window_seconds)
        count, span = len(w.steps), w.span()
        return RankSteps(
            r.job_id, r.rank, pid, t.optimizer_steps, t.steps_total, t.step_seconds_sum, tuple(t.step_buckets), dict(t.stage_seconds),
            t.backwards_total, t.collectives_total, count, w.quantile(0.5), w.quantile(0.9),
            w.ordered[-1] if count else None, count / span if span > 0 else None,
            w.backwards / count if count else None, w.shares(),
            t.stage_now, now - t.last_event if t.last_event is not None else None,
            now - t.last_step if t.last_step is not None else None,
            tuple(r.lag_buckets), r.lag_sum, r.lag_count, len(t.arrivals_in_step),
            t.step_boundary, _steps_note(t.step_boundary, self._shed_events.get(pid, 0), self.config.flood_events),
            r.lost_events)


def _steps_note(boundary: str, shed: int, flood_events: int) -> str:
    flood = (f"{shed} of its probe events were shed (over {flood_events} a second from this process, "
             "timeline.flood_events): its figures miss them") if shed else ""
    return "; ".join(note for note in (flood, tl.boundary_note(boundary)) if note)


def _threads(proc_root: Path, pid: int) -> set[int] | None:
    """The process's threads now (None when it cannot be read: nothing is dropped then)."""
    try:
        return {int(name) for name in os.listdir(f"{proc_root}/{pid}/task") if name.isdigit()}
    except OSError:
        return None


def _bucket(bounds: tuple[float, ...], value: float) -> int | None:
    for i, bound in enumerate(bounds):
        if value <= bound:
            return i
    return None


_MAPS_LINE = re.compile(rb"^([0-9a-f]+-[0-9a-f]+) (\S{4}) [0-9a-f]+ ([0-9a-f]+):([0-9a-f]+) (\d+) +(/.*)$", re.M)


def _libraries(proc_root: Path, pid: int) -> list[tuple[tuple[int, int], str, str]] | None:
    """((dev, inode), path, map_files name) of each executable mapping of a libtorch; None
    when the maps cannot be read."""
    try:
        with open(f"{proc_root}/{pid}/maps", "rb") as fh:
            text = fh.read(MAPS_MAX)
    except OSError:
        return None
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

"""Traces source: torch profiler traces from watched folders, analysed into per-rank figures.

A worker thread owned by the source reads and analyses each complete trace, off the
scrape path and the other sources' threads; ``collect()`` only hands over the latest
immutable snapshot (ticks of 0.25 s: a trace's metrics show within two seconds).

A trace counts for a job only by kernel credentials (``attribute``): the PIDs it names,
the owner of its file and of its folder; what it says is the word of whoever wrote it.
Those rules and how its rank is found: docs/traces.md (The watched folder). Logging stays
readable on a busy folder: the first trace at INFO, then a summary at most every
``SUMMARY_SECONDS``; rejected files at WARNING.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from profagent.analysis.trace.job import rank_in_file_name
from profagent.analysis.trace.model import Trace
from profagent.analysis.trace.report import analyze
from profagent.config import Config
from profagent.contracts import ProcessTree, RankTrace, TraceReport, TracesSnapshot
from profagent.errors import SourceUnavailable
from profagent.sources.traces.reader import (
    MAX_BUFFERED,
    MAX_INFLATED,
    Limits,
    TraceError,
    read_trace,
)
from profagent.sources.traces.watcher import (
    FolderWatcher,
    Processed,
    Verdict,
    default_state_dir,
    resolve_dirs,
)
from profagent.system.cputime import CPU
from profagent.system.procfs import PROC, read_credentials

log = logging.getLogger(__name__)

WORK_POLL = 0.1  # seconds between looks at files waiting to settle
WORK_IDLE = 1.0  # seconds between looks with none waiting (a new file wakes the worker at once)
WORK_SLICE = 0.5  # seconds of reading per round: the rest of a backlog waits for the next, newcomers first

STATE_FILE = "traces-processed.json"
WARN_PER_REASON = 10  # then every 1000th
PUBLISH_INTERVAL = 0.25  # default seconds between publishing (collect() never waits)
_PID_IN_NAME = re.compile(r"_(\d+)\.\d+\.pt\.trace\.json")  # tensorboard_trace_handler: host_PID.TS.pt.trace.json
_ONDEMAND_NAME = re.compile(r"^profagent_[^/]*_(\d+)\.json$")  # libkineto: <log file stem>_<pid>.json
SUMMARY_SECONDS = 60.0



def traced_pids(report: TraceReport, path: str) -> tuple[set[int], bool]:
    """The pids the trace was taken from, and whether the file is an on-demand trace."""
    name = Path(path).name
    m = _ONDEMAND_NAME.match(name)
    if m:
        return {int(m.group(1))}, True
    pids = set(report.cpu_pids)
    m = _PID_IN_NAME.search(name)
    if m:
        pids.add(int(m.group(1)))
    return pids, False


Credentials = tuple[int, frozenset[int]]  # (uid, gids) of a process


@dataclass(frozen=True)
class Attribution:
    """The job a trace counts for, or why it counts for none (``reason``, ``message``)."""

    job_id: str = ""
    reason: str = ""
    message: str = ""


def attribute(report: TraceReport, path: str, file_uid: int, tree: ProcessTree | None, *,
              alive: Callable[[int], bool], credentials: Callable[[int], Credentials | None],
              strict: bool) -> Attribution:
    """The job a trace counts for, by kernel credentials only (docs/traces.md, The watched folder).

    ``strict``: a trace must name a PID of the job (watch mode, the on-demand folder);
    otherwise a trace whose PIDs are all gone is the attached job's (``tree.job_id``).
    """
    if tree is None or not tree.processes:
        return Attribution(reason="no_job_pid", message="no job is watched")
    named, ondemand = traced_pids(report, path)
    if ondemand:
        named |= set(report.cpu_pids)  # the name and the rows must agree
    by_pid = tree.by_pid()
    jobs = {by_pid[pid].job_id for pid in named if pid in by_pid}
    outside = [pid for pid in named if pid not in by_pid]
    strict = strict or ondemand or not tree.job_id  # watch mode: no job to fall back on
    listed = ", ".join(map(str, sorted(named)))
    if len(jobs) > 1 or (outside and (strict or any(alive(pid) for pid in outside))):
        return Attribution(reason="other_process", message=f"taken from PID {listed}, not all processes of one job")
    if jobs:
        job_id = jobs.pop()
        owners = [pid for pid in named if pid in by_pid]
    elif strict:
        return Attribution(reason="no_job_pid", message="names no process (no CPU process row, no PID in its name)")
    else:  # attach mode, a folder the user named: every PID it names is gone (taken earlier)
        job_id, owners = tree.job_id, [p.pid for p in tree.processes]
    creds = [c for c in map(credentials, owners) if c is not None]
    if not creds:
        return Attribution(reason="foreign_owner", message="the job's user is unknown (its processes are gone)")
    if file_uid != 0 and all(file_uid != uid for uid, _ in creds):
        return Attribution(reason="foreign_owner", message=f"owned by uid {file_uid}, not by the job's user")
    if not any(_may_write(os.path.dirname(path), c) for c in creds):
        return Attribution(reason="foreign_folder", message="in a folder the job's user may not write")
    return Attribution(job_id)


def _may_write(folder: str, creds: Credentials) -> bool:
    uid, gids = creds
    if uid == 0:
        return True
    try:
        st = os.stat(folder)
    except OSError:
        return False
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IWUSR)
    if st.st_gid in gids:
        return bool(st.st_mode & stat.S_IWGRP)
    return bool(st.st_mode & stat.S_IWOTH)


def _credentials(pid: int) -> Credentials | None:
    return read_credentials(PROC, pid)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    except OverflowError:
        return False
    return True


def resolve_rank(report: TraceReport, path: str, tree: ProcessTree | None, job_id: str | None = None) -> str:
    """The rank of a trace (docs/traces.md, The watched folder): distributedInfo, else the
    rank of the process whose pid it records, else ``rank<N>`` or a pid in the file name,
    else the job's only rank, else ``unknown``; ``job_id``: the job it counts for, whose
    only rank is the fallback (None: the whole tree)."""
    if report.rank is not None:
        return report.rank
    by_pid = tree.by_pid() if tree is not None else {}
    for pid in sorted(traced_pids(report, path)[0]):
        info = by_pid.get(pid)
        if info is not None and info.rank:
            return info.rank
    name = Path(path).name
    from_name = rank_in_file_name(name)
    if from_name is not None:
        return from_name
    m = _PID_IN_NAME.search(name)
    if m and int(m.group(1)) in by_pid and by_pid[int(m.group(1))].rank:
        return by_pid[int(m.group(1))].rank
    mains = [] if tree is None else [p for p in tree.mains() if job_id is None or p.job_id == job_id]
    ranks = {p.rank for p in mains}
    return ranks.pop() if len(ranks) == 1 else "unknown"


class TracesSource:
    name = "traces"

    def __init__(
        self,
        dirs: list[Path],
        state_dir: Path | None,
        interval: float = 1.0,
        settle_seconds: float = 0.5,
        invalid_after: float = 60.0,
        max_file_bytes: int = 2 * 1024**3,
        max_buffered_bytes: int = MAX_BUFFERED,
        max_inflated_bytes: int = MAX_INFLATED,
        limits: Limits = Limits(),  # noqa: B008  (frozen)
        top_k: int = 10,
        polling: bool = False,
        user_dirs: bool = True,
        baseline: str = "",
        reader: Callable[[str], Trace] = read_trace,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        alive: Callable[[int], bool] = _pid_alive,
        credentials: Callable[[int], Credentials | None] = _credentials,
        strict_dirs: tuple[Path, ...] = (),
        incomplete_cpu: float = 5.0,
    ) -> None:
        self.interval = interval
        self.user_dirs = user_dirs
        self.top_k = top_k
        self._dirs = dirs
        self._watcher = FolderWatcher(dirs, Processed(state_dir / STATE_FILE if state_dir is not None else None),
                                      settle_seconds, invalid_after, max_file_bytes, polling, flat=strict_dirs,
                                      incomplete_cpu=incomplete_cpu)
        # traces.baseline comes from the config (the admin's): read it with the size cap only
        self._read_baseline_file = functools.partial(read_trace, max_bytes=max_file_bytes) \
            if reader is read_trace else reader
        if reader is read_trace:  # refuse what the job could not have written; cap the inflated size
            reader = functools.partial(read_trace, max_bytes=max_file_bytes, owner_ok=self._watcher.owner_ok,
                                       max_buffered=max_buffered_bytes, limits=limits, max_inflated=max_inflated_bytes)
        self._read = reader
        self._baseline_path = baseline
        self._baseline: tuple[TraceReport, ...] = ()
        self._clock = clock
        self._wall = wall
        self._alive = alive
        self._credentials = credentials
        self._strict_dirs = strict_dirs  # folders whose traces must name a PID of the job (on-demand)
        self._logged_first = False
        self._since_summary: dict[str, int] = {}
        self._summary_at = clock()
        self._tree: ProcessTree | None = None
        self._ranks: dict[tuple[str, str], RankTrace] = {}  # (job_id, rank) -> last trace
        self._counts: dict[tuple[str, str], int] = {("ingested", "ok"): 0}
        self._warned: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._snapshot = self._build("")

    # -- Source protocol ------------------------------------------------------------
    def start(self) -> None:
        if not self._dirs:
            raise SourceUnavailable("no trace folder configured: pass --trace-dir DIR")
        if self._baseline_path:
            self._baseline = self._read_baseline(Path(self._baseline_path))
            with self._lock:
                self._snapshot = self._build(self._snapshot.job_id)
        try:
            self._watcher.start()
        except OSError as exc:
            raise SourceUnavailable(f"cannot watch the trace folders ({exc}): check --trace-dir and permissions") from None
        self._thread = threading.Thread(target=self._work, name="profagent-traces-worker", daemon=True)
        self._thread.start()

    def collect(self, tree: ProcessTree) -> TracesSnapshot:
        """The latest snapshot the worker built (no I/O, no waiting)."""
        self._tree = tree
        self._watcher.set_job_pids(p.pid for p in tree.processes)
        with self._lock:
            live = set(tree.job_status())
            ended = [key for key in self._ranks if key[0] and key[0] not in live]
            for key in ended:  # a job that ended (watch mode) takes its series with it
                del self._ranks[key]
            if ended or self._snapshot.job_id != tree.job_id:
                self._snapshot = self._build(tree.job_id)
            return self._snapshot

    def stop(self) -> None:
        self._stop.set()
        self._watcher.stop()
        if self._thread is not None:
            self._thread.join(1.0)

    # -- worker --------------------------------------------------------------------
    def _work(self) -> None:
        while not self._stop.is_set():
            # A file waiting to settle is looked at 10 times a second; with none, a new one
            # wakes the worker (watchdog's notify), so it only sleeps (most of a job's life).
            self._watcher.wake.wait(WORK_POLL if self._watcher.waiting else WORK_IDLE)
            self._watcher.wake.clear()
            if self._tree is None:
                continue  # whose trace a file is needs the target: wait for the first collect()
            with CPU.charge("traces"):
                if self._work_once():
                    return

    def _work_once(self) -> bool:
        """Handle what is due, reading for at most WORK_SLICE (the rest waits for the next
        round, where another user's new file comes first); True if stopped meanwhile."""
        until = self._clock() + WORK_SLICE
        for verdict in self._watcher.due(self._clock()):
            if self._stop.is_set():
                return True
            if verdict.action == "attempt" and self._clock() > until:
                self._watcher.defer(verdict)
                continue
            try:
                self._handle(verdict)
            except Exception as exc:  # a bug must not end the worker: count the file
                log.debug("handling %s failed", verdict.path, exc_info=True)
                self._count(verdict, "invalid", "internal_error", f"{type(exc).__name__}: {exc}")
        if self._watcher.waiting != self._snapshot.waiting:
            with self._lock:
                self._snapshot = self._build(self._snapshot.job_id)
        return False

    def _handle(self, verdict: Verdict) -> None:
        if verdict.action != "attempt":
            self._count(verdict, verdict.action, verdict.reason, verdict.message)
            return
        started = time.thread_time()
        try:
            trace = self._read(verdict.path)
        except TraceError as exc:
            if exc.reason in ("truncated", "unreadable"):
                self._watcher.failed(verdict, exc.reason, str(exc), cpu=time.thread_time() - started)
            elif exc.reason in ("not_a_trace", "symlink", "not_regular", "foreign_owner", "too_large", "too_large_event",
                                "too_many_events", "too_many_names"):
                self._count(verdict, "skipped", exc.reason, str(exc))
            else:
                self._count(verdict, "invalid", exc.reason, str(exc))
            return
        except MemoryError:
            self._count(verdict, "skipped", "out_of_memory", "not enough memory to read it")
            return
        if len(trace) == 0 and not trace.memory:
            self._count(verdict, "skipped", "empty", "the trace has no events")
            return
        try:
            report = analyze(trace, self.top_k, in_steps=True)  # in_steps: the regression's diff
        except Exception as exc:  # an analyzer bug must not stop the watcher
            log.debug("analysing %s failed", verdict.path, exc_info=True)
            self._count(verdict, "invalid", "analysis_failed", f"{type(exc).__name__}: {exc}")
            return
        del trace
        tree = self._tree
        found = attribute(report, verdict.path, verdict.uid, tree, alive=self._alive,
                          credentials=self._credentials, strict=self._strict(verdict.path))
        if found.reason:
            self._count(verdict, "skipped", found.reason, found.message)
            return
        job_id = found.job_id
        rank = resolve_rank(report, verdict.path, tree, job_id)
        with self._lock:
            self._ranks[(job_id, rank)] = RankTrace(rank, report, self._wall(), job_id)
        self._count(verdict, "ingested", "ok", "")
        if not self._logged_first:
            self._logged_first = True
            log.info("trace %r ingested (rank %s); further traces are logged at debug level, "
                     "with a summary every %.0f s", verdict.path, rank, SUMMARY_SECONDS)
        else:
            log.debug("trace %r ingested (rank %s)", verdict.path, rank)

    def _read_baseline(self, path: Path) -> tuple[TraceReport, ...]:
        """``traces.baseline``: a trace, or the traces of a folder, analysed once. A
        baseline that cannot be read is said in one warning; each rank's first steady
        traces are the baseline then."""
        files = sorted(p for p in path.rglob("*") if p.name.endswith((".json", ".json.gz"))
                       and not p.name.startswith(".")) if path.is_dir() else [path]
        reports = []
        for file in files:
            try:
                reports.append(analyze(self._read_baseline_file(str(file)), self.top_k, in_steps=True))
            except (TraceError, MemoryError, OSError) as exc:
                log.warning("traces.baseline %r is not used: %s (fix the path or the file; each rank's "
                            "first steady traces are the baseline meanwhile)", str(file), exc)
                return ()
        if not any(r.steps for r in reports):
            log.warning("traces.baseline %r has no trace with a step: each rank's first steady traces are "
                        "the baseline", str(path))
            return ()
        return tuple(reports)

    def _strict(self, path: str) -> bool:
        return any(Path(path).is_relative_to(d) for d in self._strict_dirs)

    def _count(self, verdict: Verdict, status: str, reason: str, message: str) -> None:
        if status == "skipped" and reason == "other_process":
            log.debug("trace %r skipped: %s", verdict.path, message)  # routine with a shared folder
        elif status != "ingested":
            self._warned[reason] = n = self._warned.get(reason, 0) + 1
            if n <= WARN_PER_REASON or n % 1000 == 0:  # 10,000 planted files: not 10,000 lines
                log.warning("trace %r %s: %s%s", verdict.path, status, message or reason,
                            f" ({n} so far with reason {reason})" if n >= WARN_PER_REASON else "")
        self._since_summary[status] = self._since_summary.get(status, 0) + 1
        now = self._clock()
        if now - self._summary_at >= SUMMARY_SECONDS:
            if sum(self._since_summary.values()) > 1:
                log.info("traces in the last %.0f s: %s", now - self._summary_at,
                         ", ".join(f"{n} {k}" for k, n in sorted(self._since_summary.items())))
            self._since_summary.clear()
            self._summary_at = now
        self._watcher.finished(verdict, status)
        with self._lock:
            self._counts[(status, reason)] = self._counts.get((status, reason), 0) + 1
            self._snapshot = self._build(self._tree.job_id if self._tree is not None else "")

    def _build(self, job_id: str) -> TracesSnapshot:
        ranks = tuple(self._ranks[r] for r in sorted(self._ranks))
        counts = tuple((s, r, n) for (s, r), n in sorted(self._counts.items()))
        return TracesSnapshot(job_id, ranks, counts, self._watcher.waiting, self.top_k, self.user_dirs,
                              self._baseline)


def traces_source(config: Config, user_dirs: bool = True) -> TracesSource:
    """The source as configured (``traces.*`` keys, ``agent.state_dir``). ``user_dirs``:
    whether the user gave a folder (False when only the on-demand folder is watched)."""
    t = config.traces
    return TracesSource(
        resolve_dirs(t.dirs),
        default_state_dir(config.agent.state_dir),
        interval=t.interval if t.interval > 0 else min(config.agent.interval, PUBLISH_INTERVAL),
        settle_seconds=t.settle_seconds,
        invalid_after=t.invalid_after,
        incomplete_cpu=t.incomplete_cpu_seconds,
        max_file_bytes=t.max_file_bytes,
        max_buffered_bytes=t.max_buffered_bytes,
        max_inflated_bytes=t.max_inflated_bytes,
        limits=Limits(t.max_events, t.max_names, t.max_name_chars),
        top_k=t.top_k,
        polling=t.polling,
        user_dirs=user_dirs,
        baseline=t.baseline,
        strict_dirs=tuple(resolve_dirs([config.ondemand.trace_dir])) if config.ondemand.enabled else (),
    )

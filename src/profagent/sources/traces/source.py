"""Traces source: torch profiler traces from watched folders, analysed into per-rank figures.

A worker thread owned by the source reads and analyses each complete trace (off the
scrape path, and off the other sources' threads); ``collect()`` only hands over the
latest immutable snapshot. The source ticks every 0.25 s by default, so a trace's
metrics are visible well within two seconds of the file being complete.

The rank of a trace: ``distributedInfo.rank``, else the rank of the target process whose
pid the trace records, else ``rank<N>`` or a pid in the file name, else the job's only
rank, else ``unknown``.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from profagent.analysis.trace.model import Trace
from profagent.analysis.trace.report import TraceReport, analyze
from profagent.config import Config
from profagent.errors import SourceUnavailable
from profagent.sources.traces.reader import TraceError, read_trace
from profagent.sources.traces.watcher import (
    FolderWatcher,
    Processed,
    Verdict,
    default_state_dir,
    resolve_dirs,
)
from profagent.target import ProcessTree

log = logging.getLogger(__name__)

STATE_FILE = "traces-processed.json"
WARN_PER_REASON = 10  # then every 1000th
PUBLISH_INTERVAL = 0.25  # default seconds between publishing (collect() never waits)
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
_PID_IN_NAME = re.compile(r"_(\d+)\.\d+\.pt\.trace\.json")  # tensorboard_trace_handler: host_PID.TS.pt.trace.json


@dataclass(frozen=True)
class RankTrace:
    rank: str
    report: TraceReport
    ingested_at: float  # wall clock, seconds
    job_id: str = ""  # the job of the traced process (watch mode has several)


@dataclass(frozen=True)
class TracesSnapshot:
    job_id: str
    ranks: tuple[RankTrace, ...]
    counts: tuple[tuple[str, str, int], ...]  # (status, reason, files)
    waiting: int  # files seen but not complete yet
    top_k: int = 10


def resolve_job(report: TraceReport, tree: ProcessTree | None) -> str:
    """The job of the traced process (by pid), else the tree's job (attach mode)."""
    if tree is None:
        return ""
    by_pid = tree.by_pid()
    for pid in report.cpu_pids:
        info = by_pid.get(pid)
        if info is not None:
            return info.job_id
    return tree.job_id


def resolve_rank(report: TraceReport, path: str, tree: ProcessTree | None) -> str:
    if report.rank is not None:
        return report.rank
    by_pid = tree.by_pid() if tree is not None else {}
    for pid in report.cpu_pids:
        info = by_pid.get(pid)
        if info is not None and info.rank:
            return info.rank
    name = Path(path).name
    m = _RANK_IN_NAME.search(name)
    if m:
        return str(int(m.group(1)))
    m = _PID_IN_NAME.search(name)
    if m and int(m.group(1)) in by_pid and by_pid[int(m.group(1))].rank:
        return by_pid[int(m.group(1))].rank
    ranks = tree.ranks() if tree is not None else []
    return ranks[0] if len(ranks) == 1 else "unknown"


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
        top_k: int = 10,
        polling: bool = False,
        reader: Callable[[str], Trace] = read_trace,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.interval = interval
        self.top_k = top_k
        self._dirs = dirs
        self._watcher = FolderWatcher(dirs, Processed(state_dir / STATE_FILE if state_dir is not None else None),
                                      settle_seconds, invalid_after, max_file_bytes, polling)
        if reader is read_trace:  # refuse what the job could not have written; cap the inflated size
            reader = functools.partial(read_trace, max_bytes=max_file_bytes, owner_ok=self._watcher.owner_ok)
        self._read = reader
        self._clock = clock
        self._wall = wall
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
            self._watcher.wake.wait(0.1)
            self._watcher.wake.clear()
            for verdict in self._watcher.due(self._clock()):
                if self._stop.is_set():
                    return
                try:
                    self._handle(verdict)
                except Exception as exc:  # a bug must not end the worker: count the file
                    log.debug("handling %s failed", verdict.path, exc_info=True)
                    self._count(verdict, "invalid", "internal_error", f"{type(exc).__name__}: {exc}")
            if self._watcher.waiting != self._snapshot.waiting:
                with self._lock:
                    self._snapshot = self._build(self._snapshot.job_id)

    def _handle(self, verdict: Verdict) -> None:
        if verdict.action != "attempt":
            self._count(verdict, verdict.action, verdict.reason, verdict.message)
            return
        try:
            trace = self._read(verdict.path)
        except TraceError as exc:
            if exc.reason in ("truncated", "unreadable"):
                self._watcher.failed(verdict, exc.reason, str(exc))
            elif exc.reason in ("not_a_trace", "symlink", "not_regular", "foreign_owner", "too_large"):
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
            report = analyze(trace, self.top_k)
        except Exception as exc:  # an analyzer bug must not stop the watcher
            log.debug("analysing %s failed", verdict.path, exc_info=True)
            self._count(verdict, "invalid", "analysis_failed", f"{type(exc).__name__}: {exc}")
            return
        del trace
        rank = resolve_rank(report, verdict.path, self._tree)
        job_id = resolve_job(report, self._tree)
        with self._lock:
            self._ranks[(job_id, rank)] = RankTrace(rank, report, self._wall(), job_id)
        self._count(verdict, "ingested", "ok", "")
        log.info("trace %r ingested (rank %s)", verdict.path, rank)

    def _count(self, verdict: Verdict, status: str, reason: str, message: str) -> None:
        if status != "ingested":
            self._warned[reason] = n = self._warned.get(reason, 0) + 1
            if n <= WARN_PER_REASON or n % 1000 == 0:  # 10,000 planted files: not 10,000 lines
                log.warning("trace %r %s: %s%s", verdict.path, status, message or reason,
                            f" ({n} so far with reason {reason})" if n >= WARN_PER_REASON else "")
        self._watcher.finished(verdict, status)
        with self._lock:
            self._counts[(status, reason)] = self._counts.get((status, reason), 0) + 1
            self._snapshot = self._build(self._tree.job_id if self._tree is not None else "")

    def _build(self, job_id: str) -> TracesSnapshot:
        ranks = tuple(self._ranks[r] for r in sorted(self._ranks))
        counts = tuple((s, r, n) for (s, r), n in sorted(self._counts.items()))
        return TracesSnapshot(job_id, ranks, counts, self._watcher.waiting, self.top_k)


def traces_source(config: Config) -> TracesSource:
    """The source as configured (``traces.*`` keys, ``agent.state_dir``)."""
    t = config.traces
    return TracesSource(
        resolve_dirs(t.dirs),
        default_state_dir(config.agent.state_dir),
        interval=t.interval if t.interval > 0 else min(config.agent.interval, PUBLISH_INTERVAL),
        settle_seconds=t.settle_seconds,
        invalid_after=t.invalid_after,
        max_file_bytes=t.max_file_bytes,
        top_k=t.top_k,
        polling=t.polling,
    )

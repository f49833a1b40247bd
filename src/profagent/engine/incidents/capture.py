"""One capture: every rank's stacks (in parallel, py-spy dump), the findings, the metrics,
the trace analyses, on-demand traces when the job polls Kineto, then the summary. It
writes only through ``BundleMeta`` and the O_EXCL|O_NOFOLLOW helpers, and ends by
``incidents.capture_timeout`` whatever the ranks or their files do."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import itertools
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from profagent.analysis.incidents import LatestTrace, Trigger, self_profiling
from profagent.analysis.timeline_picture import chrome_trace
from profagent.config import IncidentsConfig
from profagent.contracts import ROLE_DATALOADER, FindingsSnapshot, ProcessInfo, ProcessTree
from profagent.engine.incidents.bundle import (
    FINDINGS,
    META,
    SUMMARY,
    TIMELINE,
    BundleMeta,
    stacks_file,
    to_json,
    trace_analysis_file,
    trace_file,
    worker_stacks_file,
)
from profagent.engine.incidents.summary import summary_text
from profagent.exporters.exposition import Exposition
from profagent.labels import printable
from profagent.sources.ondemand import kineto
from profagent.sources.ondemand.endpoint import NoPollers, TraceTarget
from profagent.sources.stacks import pyspy
from profagent.sources.traces.reader import TraceError, read_trace
from profagent.sources.traces.source import traced_pids
from profagent.state import State
from profagent.system.safefs import (
    UnsafePath,
    open_regular,
    read_nofollow,
    replace_nofollow,
    write_nofollow,
)

log = logging.getLogger(__name__)

DUMP_TIMEOUT = 20.0  # seconds per py-spy dump attempt (and never past the capture's deadline)
ONDEMAND_TRACE_MS = 1000
COPY_CHUNK = 1024 * 1024
# room kept in a bundle for what is written after the stacks (findings, metrics, summary)
SUMMARY_RESERVE = 4 << 20
TIMELINE_SECONDS = 300.0  # the picture in the bundle: the five minutes before the trigger


def _over_room(size: int, room: int, config: IncidentsConfig, copied: bool = False) -> str:
    what = f"its compressed copy passed {size} bytes" if copied else f"{size} bytes"
    return (f"{what}, more than the {room} bytes left to this bundle under incidents.max_bytes_per_user "
            f"({config.max_bytes_per_user}) and incidents.max_bytes ({config.max_bytes}); left out, raise them to keep such traces")


class CaptureHost(Protocol):
    """What a capture uses of the source that started it (``trigger.IncidentsSource``)."""

    config: IncidentsConfig
    state: State
    ondemand: Any  # the OndemandSource, or None
    timeline: Any  # the TimelineSource (``/api/timeline``'s TimelineRecorder), or None
    stopping: threading.Event
    pyspy_binary: str | None
    max_trace_bytes: int
    wall: Callable[[], float]
    uid_of: Callable[[int], int]

    def run_dump(self, args: list[str], timeout: float = ...) -> tuple[str, str]: ...

    def count_rejected(self, reason: str) -> None: ...


class Capture:
    """One bundle: every rank's stacks (in parallel), the state, traces, then the summary.
    Everything is written by ``incidents.capture_timeout`` whatever the ranks or their files do."""

    def __init__(self, source: CaptureHost, trigger: Trigger, tree: ProcessTree, folder: Path, now: float,
                 uid: int = -1) -> None:
        self.source = source
        self.trigger = trigger
        self.folder = folder
        self.now = now
        self.deadline = time.monotonic() + source.config.capture_timeout
        self.ranks = sorted((p for p in tree.mains() if p.job_id in ("", trigger.job_id)), key=_rank_order)
        # every DataLoader worker of those ranks: a hung worker is where a rank waits
        ranks = {p.rank for p in self.ranks}
        self.workers = sorted((p for p in tree.processes if p.role == ROLE_DATALOADER and p.rank in ranks
                               and p.job_id in ("", trigger.job_id)), key=lambda p: (_rank_order(p), p.pid))
        self.notes: list[str] = []
        self.files: list[str] = []
        self.stacks: dict[str, str] = {}  # rank -> dump text
        self.busy_at_request: set[int] = set()  # ranks' PIDs already tracing when the capture asked
        self.meta = BundleMeta(folder.name, trigger.kind, trigger.job_id, now, trigger.rank, trigger.reason, uid,
                               "capturing")
        self._lock = threading.Lock()  # the trigger and the summary: updated from the agent's tick
        self.updated: float | None = None  # when the trigger last changed while the bundle was open
        self.first_reason = trigger.reason

    def run(self) -> None:
        self._write(META, self.meta.to_bytes(), replace=True)
        view = self.source.state.view()
        # The picture first: the steps before the trigger, before the dumps pause the ranks
        self._timeline()
        # The stacks before the traces: a native dump stops its rank (0.3-1 s measured, more
        # on a loaded node), and in a trace that pause reads as a slow step of the rank (a
        # straggler at 2.8x the other rank's step was seen, all of it the agent's own doing).
        dumps = self._dump_all()
        if self.source.stopping.is_set():
            return  # the agent is exiting: incident.json keeps status "capturing"
        request = self._request_traces()
        for info, (text, note) in zip(self.ranks + self.workers, dumps, strict=True):
            if info.role == ROLE_DATALOADER:
                name = worker_stacks_file(info.rank, info.pid)
                what = f"rank {info.rank}'s DataLoader worker (PID {info.pid})"
            else:
                self.stacks.setdefault(info.rank, text)  # a duplicate_rank's second process: its own file only
                name, what = stacks_file(info.rank), f"rank {info.rank} (PID {info.pid})"
            # escaped as `incidents show` prints (a frame or a job id may hold ESC), within the bundle's room
            data = printable(text or f"(no stacks: {note})\n", keep_newlines=True).encode()
            room = self._room() - SUMMARY_RESERVE
            if len(data) > room:
                cut = data.rfind(b"\n", 0, max(0, room - 512)) + 1
                data = data[:cut] + (f"(truncated: {len(data) - cut} more bytes, over the room left to this bundle "
                                     f"under incidents.max_bytes_per_user and incidents.max_bytes)\n").encode()
                note = "; ".join(x for x in (note, "stacks truncated at the bundle's size cap") if x)
            self._write(self._free(name, info.pid), data)
            if note:
                self.notes.append(f"{what}: {note}")
        findings = view.findings or FindingsSnapshot((), self.now)
        with self._lock:
            trigger = self._trigger_dict()
        self._write(FINDINGS, to_json({
            "trigger": trigger,
            "findings": [f.as_dict() for f in findings.findings if f.job_id == self.trigger.job_id],
        }))
        body, _ = Exposition(lambda: view).render("text/plain")
        self._write("metrics.prom", body)
        traces = view.traces
        for rt in traces.ranks if traces is not None else ():
            if rt.job_id in ("", self.trigger.job_id):
                # The rank the agent knows (from the process), not the trace's distributedInfo,
                # which a job without torch.distributed lacks.
                self._write(self._free(trace_analysis_file(rt.rank), None),
                            to_json({"ingested_at": rt.ingested_at, **rt.report.to_dict(),
                                   "rank": rt.rank or rt.report.rank}))
        if request is not None:
            self._collect_traces(request)
        with self._lock:
            self._write(SUMMARY, printable(summary_text(self), keep_newlines=True).encode())
            if self.updated is not None:  # the trigger changed while the capture ran
                self._rewrite_trigger()
            self.meta.status = "complete"
            self.meta.completed = self.source.wall()
            self.meta.files = sorted(self.files)
            self.meta.notes = list(self.notes)
            self._write(META, self.meta.to_bytes(), replace=True)
        log.warning("incident %s captured: %s", self.folder.name, self.folder / SUMMARY)

    def _timeline(self) -> None:
        recorder = self.source.timeline
        if recorder is None or not getattr(recorder, "running", True):
            return
        try:
            history = recorder.history(TIMELINE_SECONDS, socket.gethostname(), job=self.trigger.job_id or None)
            if not history.ranks:
                return
            data = json.dumps(chrome_trace([history], TIMELINE_SECONDS), separators=(",", ":")).encode()
            room = self._room()
            if len(data) > room:
                self.notes.append(f"{TIMELINE}: {_over_room(len(data), room, self.source.config)}")
                return
            self._write(TIMELINE, data)
        except (OSError, ValueError) as exc:  # the folder went, or a value JSON cannot hold
            self.notes.append(f"timeline picture: {exc}")

    @classmethod
    def reopen(cls, source: CaptureHost, meta: BundleMeta, tree: ProcessTree) -> Capture | None:
        """A complete bundle, read back from its folder (a restart): its stacks, files and
        notes, with the trigger it last said. None if it cannot be read."""
        folder = Path(meta.path or "")
        try:
            said = json.loads(read_nofollow(folder / FINDINGS))["trigger"]
            trigger = Trigger(str(said["kind"]), str(said["job_id"]), said.get("rank"), str(said.get("reason", "")),
                              dict(said.get("evidence") or {}))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        capture = cls(source, trigger, tree, folder, meta.time or 0.0, -1 if meta.uid is None else meta.uid)
        capture.meta = dataclasses.replace(meta, path=None)
        capture.files = list(meta.files or ())
        capture.notes = list(meta.notes or ())
        capture.first_reason = meta.first_reason or trigger.reason
        for info in capture.ranks:
            with contextlib.suppress(OSError):
                capture.stacks[info.rank] = read_nofollow(folder / stacks_file(info.rank)).decode(errors="replace")
        return capture

    def update(self, trigger: Trigger, now: float) -> None:
        """The finding that caused the incident changed while it is open: from now on the
        summary (rewritten at once if already written) and incident.json say the new one."""
        with self._lock:
            self.trigger = trigger
            self.updated = now
            self.meta.rank, self.meta.reason, self.meta.updated = trigger.rank, trigger.reason, now
            self.meta.first_reason = self.first_reason
            if self.meta.status != "complete":
                return  # run() writes the summary from the new trigger
            try:
                self._write(SUMMARY, printable(summary_text(self), keep_newlines=True).encode(), replace=True)
                self._write(META, self.meta.to_bytes(), replace=True)
                self._rewrite_trigger()
            except (OSError, ValueError) as exc:  # the bundle was removed meanwhile (retention)
                log.info("cannot update incident %s: %s", self.folder.name, exc)
                return
        log.warning("incident %s updated: %s", self.folder.name, trigger.reason)

    def _rewrite_trigger(self) -> None:
        """findings.json says the trigger as it is now; the one it was captured on stays as
        ``first_trigger``, the job's findings as they were at the capture."""
        saved = json.loads(read_nofollow(self.folder / FINDINGS))
        saved.setdefault("first_trigger", saved.get("trigger"))
        saved["trigger"] = self._trigger_dict()
        self._write(FINDINGS, to_json(saved), replace=True)

    def _trigger_dict(self) -> dict[str, Any]:
        t = self.trigger
        return {"kind": t.kind, "job_id": t.job_id, "rank": t.rank, "reason": t.reason, "evidence": dict(t.evidence)}

    def _remaining(self) -> float:
        return self.deadline - time.monotonic()

    def _free(self, name: str, pid: int | None, taken: set[str] | frozenset[str] = frozenset()) -> str:
        """``name``, or ``name`` with ``-pidN`` when a file of that name is in the bundle
        already: two processes of a job may claim one rank (``duplicate_rank``), and two
        ranks may have one safe_name ("a b", "a_b"); a capture never fails on it."""
        stem, dot, ext = name.partition(".")
        tag = f"{stem}-pid{pid}" if pid is not None else stem
        candidates = itertools.chain((name, f"{tag}{dot}{ext}"), (f"{tag}-{n}{dot}{ext}" for n in itertools.count(2)))
        return next(c for c in candidates
                    if c not in self.files and c not in taken and not os.path.lexists(self.folder / c))

    def _write(self, name: str, data: bytes, replace: bool = False) -> None:
        path = self.folder / name
        (replace_nofollow if replace else write_nofollow)(path, data)
        if name not in (META,) and name not in self.files:
            self.files.append(name)

    # -- stacks ----------------------------------------------------------------------------
    def _dump_all(self) -> list[tuple[str, str]]:
        """Every rank's dump, in parallel. Daemon threads rather than a ThreadPoolExecutor:
        the interpreter joins executor workers at exit, which held a SIGTERMed agent for as
        long as a slow dump took (53 s once)."""
        targets = self.ranks + self.workers
        results: list[tuple[str, str]] = [("", "not dumped")] * len(targets)

        def one(i: int, info: ProcessInfo) -> None:
            results[i] = self._dump(info)

        threads = [threading.Thread(target=one, args=(i, info), name="profagent-incident-dump", daemon=True)
                   for i, info in enumerate(targets)]
        for t in threads:
            t.start()
        for t in threads:  # each dump is killed by the deadline; a second more for the reaping
            t.join(max(0.0, self._remaining()) + 1.0)
        return [r if not t.is_alive() else ("", "not finished by incidents.capture_timeout")
                for r, t in zip(results, threads, strict=True)]

    def _dump(self, info: ProcessInfo) -> tuple[str, str]:
        """(dump text, note). Native frames first; a py-spy build without them falls back."""
        binary = self.source.pyspy_binary
        if binary is None:
            return "", "py-spy is not installed"
        unsafe = pyspy.unsafe_interpreter(info.pid)
        if unsafe:
            return "", f"no py-spy dump: {unsafe}"
        errors = []
        stopped_before = pyspy.is_stopped(info.pid)
        try:
            for mode in pyspy.DUMP_MODES:
                timeout = min(DUMP_TIMEOUT, self._remaining())
                text, err = self.source.run_dump(pyspy.dump_text_args(binary, info.pid, mode), timeout)
                text = redact_header(text, info.cmdline)
                if text:
                    return text, ("" if mode == "native" else f"without native frames ({'; '.join(errors)})")
                errors.append(f"{mode}: {err}")
        finally:
            if pyspy.resume_if_stopped(info.pid, stopped_before):
                log.warning("PID %d was left stopped after py-spy dump: resumed it", info.pid)
        return "", "py-spy dump failed: " + "; ".join(errors)

    # -- on-demand traces ------------------------------------------------------------------
    def _request_traces(self) -> Any:
        ondemand = self.source.ondemand
        if ondemand is None:
            return None
        pollers = {p.pid: p for p in ondemand.endpoint.pollers()}
        # now, not the trigger's time: the dumps took seconds, and a trace the rank wrote
        # meanwhile is younger than the trigger
        now = self.source.wall()
        own = self._self_profiling(now)
        wanted = set()
        some_poll = any(info.pid in pollers for info in self.ranks)
        for info in self.ranks:
            poller = pollers.get(info.pid)
            if poller is None:
                if some_poll:
                    self.notes.append(f"no on-demand trace of rank {info.rank}: not polling Kineto (KINETO_USE_DAEMON=1 unset)")
            elif info.rank in own:
                # not asked even when its poll says it is free: it drops the request when its
                # own next window starts, and waiting for it held every capture to its deadline
                self.notes.append(f"no on-demand trace of rank {info.rank}{self._profiles_itself(own[info.rank], now)}")
            else:
                # A rank busy with a trace now gets the request at its first free poll: the
                # endpoint sends a config only to a poll that can trace.
                wanted.add(info.pid)
                if not poller.can_trace:
                    self.busy_at_request.add(info.pid)
        try:
            return ondemand.request(lambda p: p.pid in wanted,
                                    kineto.TraceOptions(duration_ms=ONDEMAND_TRACE_MS),
                                    self.source.config.capture_timeout)
        except NoPollers:
            if not some_poll:
                self.notes.append("no on-demand traces: the job does not poll Kineto (start it with KINETO_USE_DAEMON=1)")
            return None

    def _collect_traces(self, request: Any) -> None:
        rank_of = {p.pid: p.rank for p in self.ranks}
        uid_of = {p.pid: self.source.uid_of(p.pid) for p in self.ranks}
        waiting = dict(request.targets)
        seen: dict[int, tuple[int, int, int]] = {}  # pid -> (inode, size, mtime) of the last look
        refused: dict[int, str] = {}
        names: dict[int, str] = {}  # pid -> its trace's file (two processes may claim one rank)
        while waiting and self._remaining() > 0 and not self.source.stopping.is_set():
            for pid, target in list(waiting.items()):
                name = names.get(pid) or names.setdefault(pid, self._free(trace_file(rank_of.get(pid, str(pid))), pid,
                                                                          set(names.values())))
                try:
                    done = self._copy_trace(Path(target.file), name, uid_of.get(pid, -1), seen, pid)
                except TraceError as exc:  # refused for good: counted, said, not waited for
                    self.source.count_rejected(exc.reason)
                    refused[pid] = f"{exc.reason}: {exc}"
                    del waiting[pid]
                    continue
                if done:
                    del waiting[pid]
            if waiting:
                time.sleep(min(0.25, max(0.0, self._remaining())))
        for pid, why in refused.items():
            self.notes.append(f"on-demand trace of rank {rank_of.get(pid, pid)} (PID {pid}) refused ({why})")
        now = self.source.wall()  # the ranks went on writing their own traces during the capture
        own = self._self_profiling(now)
        for pid, target in waiting.items():
            rank = rank_of.get(pid, str(pid))
            self.notes.append(f"no on-demand trace from rank {rank} (PID {pid}) within "
                              f"{self.source.config.capture_timeout:g} s{self._no_trace_why(target, rank, own, now)}")

    def _no_trace_why(self, target: TraceTarget, rank: str, own: dict[str, LatestTrace], now: float) -> str:
        """Why a rank that was asked for a trace sent none, for the bundle's notes."""
        if rank in own:
            return self._profiles_itself(own[rank], now)
        if target.sent_at is not None:
            times = f" {1 + target.resent} times (it polled free with no trace: libkineto dropped it)" if target.resent else ""
            return f": it was sent the config{times}; no complete trace came to {target.file}"
        if target.pid in self.busy_at_request:
            return ": it was busy with another trace when asked, and stayed so"
        return ": it did not poll free to trace (libkineto polls every ~5 s)"

    def _room(self) -> int:
        """Bytes this bundle may still take: incidents.max_bytes_per_user (and max_bytes)
        less what is in it already. A bundle over its user's cap would evict every other
        bundle of that user and still be over."""
        caps = [c for c in (self.source.config.max_bytes_per_user, self.source.config.max_bytes) if c > 0]
        if not caps:
            return self.source.max_trace_bytes
        used = 0
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.folder):
                with contextlib.suppress(OSError):
                    used += entry.stat(follow_symlinks=False).st_size
        return max(0, min(caps) - used)

    def _copy_trace(self, path: Path, name: str, uid: int, seen: dict[int, tuple[int, int, int]], pid: int) -> bool:
        """Copy the rank's trace into the bundle (gzip) once libkineto has finished it (it
        parses). Opened with O_NOFOLLOW|O_NONBLOCK; only a regular file of the rank's user
        (or root) within traces.max_file_bytes is read, at most that much, then checked by
        the traces reader (its inflated-size and buffering caps) on our private copy.
        The copy must also fit the bundle's room under incidents.max_bytes_per_user: a gzip
        trace larger than that is refused before a byte is copied, a plain one once its
        compressed copy outgrows it (``over_bundle_cap``).
        False: not there or not complete yet. Raises TraceError when refused for good."""
        cap = self.source.max_trace_bytes
        room = self._room()
        try:
            fd = open_regular(str(path), lambda owner: owner in (0, uid))
        except FileNotFoundError:
            return False
        except UnsafePath as exc:
            raise TraceError(str(exc), exc.reason) from None
        except OSError as exc:
            raise TraceError(f"cannot open it ({exc.strerror or exc})", "unreadable") from None
        tmp = self.folder / f".{name}.part"
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if st.st_size > cap:
                raise TraceError(f"{st.st_size} bytes is over traces.max_file_bytes ({cap})", "too_large")
            sig = (st.st_ino, st.st_size, st.st_mtime_ns)
            if not st.st_size or seen.get(pid) == sig:
                return False  # empty, or unchanged since it was found incomplete
            seen[pid] = sig
            chunk = fh.read(COPY_CHUNK)
            already = chunk[:2] == b"\x1f\x8b"  # a gzip trace is copied as it is
            if already and st.st_size > room:
                raise TraceError(_over_room(st.st_size, room, self.source.config), "over_bundle_cap")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            out = os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), "wb")
            copied = 0
            with out, (contextlib.nullcontext(out) if already else gzip.GzipFile(fileobj=out, mode="wb", compresslevel=6)) as sink:
                while chunk:
                    copied += len(chunk)
                    if copied > cap or out.tell() > room:  # it grew after fstat, or compresses too little
                        break
                    sink.write(chunk)
                    chunk = fh.read(COPY_CHUNK)
            written = os.stat(tmp).st_size
        try:
            if copied > cap:
                raise TraceError(f"over traces.max_file_bytes ({cap}) while read", "too_large")
            if written > room:
                raise TraceError(_over_room(written, room, self.source.config, copied=True), "over_bundle_cap")
            read_trace(tmp, max_bytes=cap)
        except TraceError as exc:
            os.unlink(tmp)
            if exc.reason == "truncated":
                return False  # still being written: looked at again once it changes
            raise
        os.replace(tmp, self.folder / name)
        self.files.append(name)
        return True

    @staticmethod
    def _profiles_itself(t: LatestTrace, now: float) -> str:
        return (f": it profiles itself (its torch.profiler wrote {Path(t.file).name} {now - t.ingested_at:.0f} s "
                f"earlier, analysed in {trace_analysis_file(t.rank)}), and libkineto runs one profiler at a time")

    def _self_profiling(self, now: float) -> dict[str, LatestTrace]:
        traces = self.source.state.view().traces
        latest = [LatestTrace(rt.job_id, rt.rank, rt.report.path, traced_pids(rt.report, rt.report.path)[1],
                              rt.ingested_at) for rt in (traces.ranks if traces is not None else ())]
        return self_profiling(latest, self.trigger.job_id, now)


# py-spy's dump starts "Process 4242: <the whole command line>", then "Python v3.11.7 (...)";
# the command line may span lines (python -c "...") and carries what the job was given
_PROCESS_HEADER = re.compile(r"Process (\d+): ")


def redact_header(text: str, cmdline: str) -> str:
    """``text`` with py-spy's "Process N: <command line>" header showing ``cmdline`` instead,
    the process' cmdline label (program and script; arguments only with agent.cmdline_args,
    their secrets hidden): the command line carries tokens a bundle must not."""
    m = _PROCESS_HEADER.match(text)
    if m is None:
        return text
    end = text.find("\nPython v")
    if end < 0:
        end = text.find("\nThread ")
    return f"Process {m.group(1)}: {cmdline}" + (text[end:] if end >= 0 else "\n")


def _rank_order(p: ProcessInfo) -> tuple[int, str]:
    return (int(p.rank), "") if p.rank.isdigit() else (1 << 30, p.rank)

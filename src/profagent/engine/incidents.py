"""Incident bundles: when a job hangs or slows down, capture the evidence on every rank.

``IncidentsSource`` runs in the runtime like a source: each tick it reads the job's
state (the ``findings`` snapshot, else stalled ranks from ``stacks``; the ``traces``
snapshot for step-time regressions), asks the pure ``IncidentGate`` whether to capture,
and starts at most one ``capture`` thread. It publishes ``IncidentsSnapshot`` (counts
for ``profagent_incidents_total``).

A bundle is one 0700 folder under the agent's state folder (never where users' files
live), written with O_NOFOLLOW|O_EXCL so a planted symlink is never followed:
``incident.json`` (id, kind, job_id, time, path, status), ``stacks-rank<R>.txt``,
``findings.json``, ``metrics.prom``, ``trace-analysis-rank<R>.json``,
``trace-rank<R>.pt.trace.json.gz`` (when the job polls Kineto) and ``summary.md``.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from profagent.analysis.findings import FindingsSnapshot
from profagent.analysis.incidents import (
    KINDS,
    IncidentGate,
    LatestTrace,
    RegressionDetector,
    Stored,
    Trigger,
    hang_triggers,
    self_profiling,
    to_remove,
)
from profagent.config import IncidentsConfig
from profagent.errors import SourceUnavailable, UserError
from profagent.exporters.exposition import Exposition
from profagent.sources.ondemand import kineto
from profagent.sources.ondemand.endpoint import NoPollers
from profagent.sources.stacks import pyspy
from profagent.sources.traces.source import traced_pids
from profagent.sources.traces.watcher import default_state_dir
from profagent.state import State, StateView
from profagent.target import ProcessInfo, ProcessTree

log = logging.getLogger(__name__)

META = "incident.json"
SUMMARY = "summary.md"
DUMP_TIMEOUT = 20.0  # seconds per py-spy dump attempt
ONDEMAND_TRACE_MS = 1000
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def incidents_dir(config: IncidentsConfig, state_dir: str) -> Path:
    """incidents.dir, else <agent state folder>/incidents (/var/lib/profagent/incidents as root)."""
    return Path(config.dir) if config.dir else default_state_dir(state_dir) / "incidents"


# -- storage --------------------------------------------------------------------------------
class IncidentStore:
    """The incidents folder: one 0700 folder per incident, bounded in count and bytes."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def ensure_root(self) -> None:
        """Create the folder 0700 (parents too). Raises OSError if it is a symlink or not ours."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(self.root)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(f"{self.root} is not a folder owned by this user")
        os.chmod(self.root, 0o700)

    def create(self, kind: str, job_id: str, now: float) -> Path:
        """A new empty incident folder (mkdir fails on anything already there, symlinks too)."""
        self.ensure_root()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        base = f"{stamp}-{_UNSAFE.sub('_', job_id)[:40] or 'job'}-{kind}"
        for n in range(1000):
            path = self.root / (base if n == 0 else f"{base}-{n}")
            try:
                os.mkdir(path, 0o700)
                return path
            except FileExistsError:
                continue
        raise OSError(f"too many incidents named {base}")

    def list(self) -> list[dict[str, Any]]:
        """Every incident's metadata, oldest first (unreadable folders are skipped)."""
        out = []
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return []
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            try:
                meta = json.loads(read_nofollow(Path(entry.path) / META))
            except (OSError, ValueError):
                continue
            if isinstance(meta, dict) and meta.get("id") == entry.name:
                meta["path"] = entry.path
                out.append(meta)
        return sorted(out, key=lambda m: (m.get("time", 0), m["id"]))

    def prune(self, max_count: int, max_bytes: int) -> list[str]:
        """Remove the oldest incidents beyond the limits; returns the ids removed."""
        stored = [Stored(m["id"], float(m.get("time", 0)), _folder_bytes(Path(m["path"]))) for m in self.list()]
        removed = to_remove(stored, max_count, max_bytes)
        for incident_id in removed:
            shutil.rmtree(self.root / incident_id, ignore_errors=True)  # rmtree never follows symlinks
        return removed


def write_nofollow(path: Path, data: bytes) -> None:
    """Create ``path`` 0600; fails rather than follow or overwrite anything planted there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def replace_nofollow(path: Path, data: bytes) -> None:
    """Write ``path`` atomically through a fresh temporary file in the same folder."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    write_nofollow(tmp, data)
    os.replace(tmp, path)


def read_nofollow(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def _folder_bytes(path: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            with contextlib.suppress(OSError):
                total += entry.stat(follow_symlinks=False).st_size
    return total


# -- the source ------------------------------------------------------------------------------
@dataclass(frozen=True)
class IncidentsSnapshot:
    counts: tuple[tuple[str, str, int], ...]  # (job_id, kind, incidents captured)
    suppressed: tuple[tuple[str, str, int], ...] = ()  # (job_id, kind, triggers rate-limited)


class CaptureSlot:
    """Only one capture runs at a time (shared by every job of an agent)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def acquire(self) -> bool:
        return self._lock.acquire(blocking=False)

    def release(self) -> None:
        self._lock.release()

    @property
    def busy(self) -> bool:
        return self._lock.locked()


class IncidentsSource:
    """Evaluates triggers every tick and runs captures (see the module docstring)."""

    name = "incidents"

    def __init__(
        self,
        config: IncidentsConfig,
        root: Path,
        state: State,
        interval: float = 1.0,
        ondemand: Any = None,  # the OndemandSource, for traces when the job polls Kineto
        slot: CaptureSlot | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.store = IncidentStore(root)
        self.state = state
        self.interval = interval
        self.ondemand = ondemand
        self.slot = slot or CaptureSlot()
        self._wall = wall
        self._gate = IncidentGate(config.rate_limit_seconds)
        self._regression = RegressionDetector(config.regression_factor, config.regression_seconds)
        self._lock = threading.Lock()  # the gate and the counts (control requests come from another thread)
        self._counts: dict[tuple[str, str], int] = {}
        self._suppressed: dict[tuple[str, str], int] = {}
        self._thread: threading.Thread | None = None
        self._binary: str | None = None
        self.last_error = ""
        self.stopping = threading.Event()
        self._dumps_lock = threading.Lock()
        self._dumps: set[subprocess.Popen] = set()  # running py-spy dumps, killed by stop()

    def start(self) -> None:
        try:
            self.store.ensure_root()
        except OSError as exc:
            raise SourceUnavailable(f"cannot use the incidents folder {self.store.root} ({exc}): set incidents.dir") from None
        try:
            self._binary = pyspy.find_pyspy()
        except pyspy.PySpyProblem as exc:
            log.warning("incidents will have no stacks: %s", exc)

    def stop(self) -> None:
        """Abandon a running capture: its py-spy dumps are killed (a dump can take many
        seconds under load) and its daemon thread is not waited for beyond a second."""
        self.stopping.set()
        with self._dumps_lock:
            dumps = list(self._dumps)
        pyspy.stop_all(dumps, grace=0.2)
        if self._thread is not None:
            self._thread.join(1.0)

    def run_dump(self, args: list[str]) -> tuple[str, str]:
        """(stdout, first error line) of one py-spy dump; killed and reaped if it overruns
        or the agent stops."""
        if self.stopping.is_set():
            return "", "the agent is stopping"
        try:
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=pyspy.die_with_parent(), env={**os.environ, "RUST_BACKTRACE": "0"})
        except OSError as exc:
            return "", str(exc)
        with self._dumps_lock:
            self._dumps.add(proc)
        try:
            out, err = proc.communicate(timeout=DUMP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pyspy.stop_all([proc], grace=0.2)
            return "", f"timed out after {DUMP_TIMEOUT:g} s"
        finally:
            with self._dumps_lock:
                self._dumps.discard(proc)
        if self.stopping.is_set():
            return "", "the agent is stopping"
        if proc.returncode == 0 and "Thread " in out:
            return out, ""
        return "", pyspy.first_line(err or out)

    def collect(self, tree: ProcessTree) -> IncidentsSnapshot:
        view = self.state.view()
        now = self._wall()
        triggers = hang_triggers(self._findings(view, now)) + self._regressions(view, tree, now)
        live = tree.job_status()
        with self._lock:
            decisions = self._gate.offer([t for t in triggers if live.get(t.job_id, True)], self.slot.busy, now)
            for d in decisions:
                if d.action == "rate_limited":
                    self._suppressed[d.trigger.key[::-1]] = self._suppressed.get(d.trigger.key[::-1], 0) + 1
                    log.info("incident %s in job %s not captured: rate limit (%g s)",
                             d.trigger.kind, d.trigger.job_id, self.config.rate_limit_seconds)
        for d in decisions:
            if d.action == "capture":
                self._start(d.trigger, tree, now)
        with self._lock:  # every series exists from the start, so changes() sees the first incident
            for job_id in live:
                for kind in KINDS:
                    self._counts.setdefault((job_id, kind), 0)
        return self._snapshot(set(live))

    def _snapshot(self, live: set[str]) -> IncidentsSnapshot:
        with self._lock:
            counts = tuple((j, k, n) for (j, k), n in sorted(self._counts.items()) if j in live)
            suppressed = tuple((j, k, n) for (j, k), n in sorted(self._suppressed.items()) if j in live)
        return IncidentsSnapshot(counts, suppressed)

    def _findings(self, view: StateView, now: float) -> FindingsSnapshot:
        snap = view.snapshots.get("findings")  # published by the findings engine every tick
        return snap if snap is not None else FindingsSnapshot((), now)

    def _regressions(self, view: StateView, tree: ProcessTree, now: float) -> list[Trigger]:
        traces = view.snapshots.get("traces")
        for rt in getattr(traces, "ranks", ()):
            if rt.report.step_mean:
                self._regression.observe(rt.job_id or tree.job_id, rt.rank, rt.report.step_mean, rt.ingested_at)
        self._regression.forget(tree.job_status())
        return self._regression.triggers(now)

    # -- manual requests (control op "incident") --------------------------------------------
    def request(self, job_id: str | None, reason: str = "") -> dict[str, Any]:
        """Capture now for ``job_id`` (None: the job, when there is one). Reply for the control socket."""
        tree = self.state.tree
        jobs = [j for j, alive in (tree.job_status() if tree else {}).items() if alive]
        job = job_id or (jobs[0] if len(jobs) == 1 else None)
        if job is None or job not in jobs:
            return {"ok": False, "error": f"no live job {job_id!r} (jobs: {', '.join(jobs) or 'none'})"}
        now = self._wall()
        trigger = Trigger("manual", job, None, reason or "requested with `profagent incidents capture`")
        with self._lock:
            action = self._gate.ask(trigger.key, self.slot.busy, now)
            wait = self._gate.retry_after(trigger.key, now)
        if action == "busy":
            return {"ok": False, "error": "busy: another capture is running, try again in a few seconds"}
        if action == "rate_limited":
            return {"ok": False, "error": f"rate limited: one manual incident per job every {self.config.rate_limit_seconds:g} s "
                    f"(incidents.rate_limit_seconds); next in {wait:.0f} s"}
        path = self._start(trigger, tree, now)
        if path is None:
            return {"ok": False, "error": f"could not start the capture: {self.last_error}"}
        return {"ok": True, "id": path.name, "path": str(path)}

    # -- capture ---------------------------------------------------------------------------
    def _start(self, trigger: Trigger, tree: ProcessTree | None, now: float) -> Path | None:
        if tree is None or not self.slot.acquire():
            self.last_error = "another capture is running"
            return None
        try:
            folder = self.store.create(trigger.kind, trigger.job_id, now)
        except OSError as exc:
            self.slot.release()
            self.last_error = str(exc)
            log.warning("cannot create an incident folder under %s: %s", self.store.root, exc)
            return None
        with self._lock:
            key = (trigger.job_id, trigger.kind)
            self._counts[key] = self._counts.get(key, 0) + 1
        log.warning("incident %s: %s in job %s (%s); capturing into %s",
                    folder.name, trigger.kind, trigger.job_id, trigger.reason, folder)
        self._thread = threading.Thread(target=self._capture, args=(trigger, tree, folder, now),
                                        name="profagent-incident", daemon=True)
        self._thread.start()
        return folder

    def _capture(self, trigger: Trigger, tree: ProcessTree, folder: Path, now: float) -> None:
        try:
            Capture(self, trigger, tree, folder, now).run()
        except Exception:
            log.exception("incident capture into %s failed", folder)
        finally:
            self.slot.release()
            with contextlib.suppress(OSError):
                removed = self.store.prune(self.config.max_count, self.config.max_bytes)
                if removed:
                    log.info("removed old incidents: %s", ", ".join(removed))


class Capture:
    """One bundle: every rank's stacks (in parallel), the state, traces, then the summary."""

    def __init__(self, source: IncidentsSource, trigger: Trigger, tree: ProcessTree, folder: Path, now: float) -> None:
        self.source = source
        self.trigger = trigger
        self.folder = folder
        self.now = now
        self.ranks = sorted((p for p in tree.mains() if p.job_id in ("", trigger.job_id)), key=_rank_order)
        self.notes: list[str] = []
        self.files: list[str] = []
        self.stacks: dict[str, str] = {}  # rank -> dump text
        self.busy_at_request: set[int] = set()  # ranks' PIDs already tracing when the capture asked
        self.meta = {"id": folder.name, "kind": trigger.kind, "job_id": trigger.job_id, "time": now,
                     "rank": trigger.rank, "reason": trigger.reason, "status": "capturing"}

    def run(self) -> None:
        self._write(META, _json(self.meta), replace=True)
        view = self.source.state.view()
        deadline = time.monotonic() + self.source.config.capture_timeout
        request = self._request_traces()  # first: ranks pick it up at their next poll
        dumps = self._dump_all()
        if self.source.stopping.is_set():
            return  # the agent is exiting: incident.json keeps status "capturing"
        for info, (text, note) in zip(self.ranks, dumps, strict=True):
            self.stacks[info.rank] = text
            self._write(f"stacks-rank{_safe(info.rank)}.txt", (text or f"(no stacks: {note})\n").encode())
            if note:
                self.notes.append(f"rank {info.rank} (PID {info.pid}): {note}")
        findings = view.snapshots.get("findings") or FindingsSnapshot((), self.now)
        self._write("findings.json", _json({
            "trigger": {"kind": self.trigger.kind, "job_id": self.trigger.job_id, "rank": self.trigger.rank,
                        "reason": self.trigger.reason, "evidence": dict(self.trigger.evidence)},
            "findings": [f.as_dict() for f in findings.findings if f.job_id == self.trigger.job_id],
        }))
        body, _ = Exposition(lambda: view).render("text/plain")
        self._write("metrics.prom", body)
        traces = view.snapshots.get("traces")
        for rt in getattr(traces, "ranks", ()):
            if rt.job_id in ("", self.trigger.job_id):
                self._write(f"trace-analysis-rank{_safe(rt.rank)}.json",
                            _json({"ingested_at": rt.ingested_at, **rt.report.to_dict()}))
        if request is not None:
            self._collect_traces(request, deadline)
        self._write(SUMMARY, self._summary().encode())
        self.meta["status"] = "complete"
        self.meta["files"] = sorted(self.files)
        self._write(META, _json(self.meta), replace=True)
        log.warning("incident %s captured: %s", self.folder.name, self.folder / SUMMARY)

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
        results: list[tuple[str, str]] = [("", "not dumped")] * len(self.ranks)

        def one(i: int, info: ProcessInfo) -> None:
            results[i] = self._dump(info)

        threads = [threading.Thread(target=one, args=(i, info), name="profagent-incident-dump", daemon=True)
                   for i, info in enumerate(self.ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    def _dump(self, info: ProcessInfo) -> tuple[str, str]:
        """(dump text, note). Native frames first; a py-spy build without them falls back."""
        binary = self.source._binary
        if binary is None:
            return "", "py-spy is not installed"
        errors = []
        stopped_before = pyspy.is_stopped(info.pid)
        try:
            for mode in pyspy.DUMP_MODES:
                text, err = self.source.run_dump(pyspy.dump_text_args(binary, info.pid, mode))
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
        own = self._self_profiling(self.now)
        wanted = set()
        some_poll = any(info.pid in pollers for info in self.ranks)
        for info in self.ranks:
            poller = pollers.get(info.pid)
            if poller is None:
                if some_poll:
                    self.notes.append(f"no on-demand trace of rank {info.rank}: not polling Kineto (KINETO_USE_DAEMON=1 unset)")
            elif not poller.can_trace and info.rank in own:
                self.notes.append(f"no on-demand trace of rank {info.rank}{self._profiles_itself(own[info.rank], self.now)}")
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

    def _collect_traces(self, request: Any, deadline: float) -> None:
        rank_of = {p.pid: p.rank for p in self.ranks}
        waiting = dict(request.targets)
        while waiting and time.monotonic() < deadline and not self.source.stopping.is_set():
            for pid, target in list(waiting.items()):
                data = _complete_trace(Path(target.file))
                if data is not None:
                    # A copy: the user's (and the traces source's) file stays where it is.
                    self._write(f"trace-rank{_safe(rank_of.get(pid, str(pid)))}.pt.trace.json.gz", gzip.compress(data, 6))
                    del waiting[pid]
            if waiting:
                time.sleep(0.25)
        now = self.source._wall()  # the ranks went on writing their own traces during the capture
        own = self._self_profiling(now)
        for pid in waiting:
            rank = rank_of.get(pid, str(pid))
            why = ""
            if rank in own:
                why = self._profiles_itself(own[rank], now)
            elif pid in self.busy_at_request:
                why = ": it was busy with another trace when asked, and stayed so"
            self.notes.append(f"no on-demand trace from rank {rank} (PID {pid}) within "
                              f"{self.source.config.capture_timeout:g} s{why}")

    @staticmethod
    def _profiles_itself(t: LatestTrace, now: float) -> str:
        return (f": it profiles itself (its torch.profiler wrote {Path(t.file).name} {now - t.ingested_at:.0f} s "
                f"earlier, analysed in trace-analysis-rank{_safe(t.rank)}.json), and libkineto runs one profiler at a time")

    def _self_profiling(self, now: float) -> dict[str, LatestTrace]:
        traces = self.source.state.view().snapshots.get("traces")
        latest = [LatestTrace(rt.job_id, rt.rank, rt.report.path, traced_pids(rt.report, rt.report.path)[1],
                              rt.ingested_at) for rt in getattr(traces, "ranks", ())]
        return self_profiling(latest, self.trigger.job_id, now)

    # -- summary -------------------------------------------------------------------------
    def _summary(self) -> str:
        t = self.trigger
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.now))
        by_rank = {p.rank: p for p in self.ranks}
        rank = t.rank if t.rank in by_rank else (self.ranks[0].rank if self.ranks else None)
        where = innermost_frame(self.stacks.get(rank or "", "")) if rank is not None else None
        title = {"hang": "a rank hangs", "regression": "step time regressed", "manual": "capture on request"}[t.kind]
        lines = [
            f"# Incident {self.folder.name}: {title} (job {t.job_id})", "",
            f"- **What happened**: {t.reason}",
            f"- **When**: {when}",
            f"- **Which rank**: {f'rank {rank} (PID {by_rank[rank].pid})' if rank in by_rank else 'the whole job'}",
            f"- **Which line**: {f'`{where}` (innermost Python frame of its main thread)' if where else 'unknown (no stacks)'}",
            "", "## Every rank", "", "| rank | PID | innermost Python frame of the main thread |", "| --- | --- | --- |",
        ]
        for p in self.ranks:
            frame = innermost_frame(self.stacks.get(p.rank, ""))
            lines.append(f"| {p.rank} | {p.pid} | {f'`{frame}`' if frame else '-'} |")
        evidence = dict(t.evidence)
        if evidence:
            lines += ["", "## Evidence", "", "```json", json.dumps(evidence, indent=2, default=str), "```"]
        lines += ["", "## Files", ""] + [f"- `{name}`" for name in sorted(self.files)]
        if self.notes:
            lines += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


_FRAME = re.compile(r"^\s+(\S.*?) \((\S+\.py):(\d+)\)\s*$")
_THREAD = re.compile(r'^Thread \S+ \((\w+)\): "([^"]*)"')


def innermost_frame(dump: str) -> str | None:
    """``function (file.py:line)`` of the main thread's innermost Python frame in a py-spy
    text dump (the first thread when none is named MainThread)."""
    blocks: list[tuple[str, list[str]]] = []
    for line in dump.splitlines():
        m = _THREAD.match(line)
        if m:
            blocks.append((m.group(2), []))
        elif blocks:
            f = _FRAME.match(line)
            if f:
                blocks[-1][1].append(f"{f.group(1)} ({f.group(2)}:{f.group(3)})")
    main = next((frames for name, frames in blocks if name == "MainThread"), blocks[0][1] if blocks else [])
    return main[0] if main else None


def _complete_trace(path: Path) -> bytes | None:
    """The trace's bytes once libkineto has finished writing it (it parses as JSON)."""
    try:
        data = read_nofollow(path)
        return data if data and isinstance(orjson.loads(data), dict) else None
    except (OSError, orjson.JSONDecodeError):
        return None


def _json(data: Any) -> bytes:
    return json.dumps(data, indent=2, default=str).encode() + b"\n"


def _safe(rank: str) -> str:
    return _UNSAFE.sub("_", rank) or "unknown"


def _rank_order(p: ProcessInfo) -> tuple[int, str]:
    return (int(p.rank), "") if p.rank.isdigit() else (1 << 30, p.rank)


# -- reading (CLI, HTTP) ---------------------------------------------------------------------
def incidents_route(
    store: IncidentStore, jobs: Callable[[], Iterable[str]] | None = None,
) -> Callable[[dict[str, list[str]]], tuple[int, str, bytes]]:
    """GET /api/incidents[?job=J] -> ``{"incidents": [{id, kind, job_id, time, path, rank,
    reason, status}, ...]}``, oldest first (an object, like /api/findings and /api/ranks);
    GET /api/incidents?id=ID -> that incident with its ``summary`` (Markdown) and ``files``.

    ``jobs`` (attach mode) gives the job ids this agent observes: the store's folder is
    shared by every agent of the user, so only their bundles are listed (docs/openapi.yaml)."""
    keys = ("id", "kind", "job_id", "time", "path", "rank", "reason", "status")

    def listed(job: str | None) -> list[dict[str, Any]]:
        mine = None if jobs is None else set(jobs())
        return [m for m in store.list()
                if (mine is None or m.get("job_id") in mine) and job in (None, m.get("job_id"))]

    def route(query: dict[str, list[str]]) -> tuple[int, str, bytes]:
        wanted = (query.get("id") or [""])[0]
        job = (query.get("job") or [None])[0]
        items = listed(job)
        if not wanted:
            return 200, "application/json", orjson.dumps({"incidents": [{k: m.get(k) for k in keys} for m in items]})
        meta = next((m for m in items if m["id"] == wanted), None)
        if meta is None:
            return 404, "text/plain", f"no incident {wanted!r} of this agent's jobs\n".encode()
        return 200, "application/json", orjson.dumps({**{k: meta.get(k) for k in keys}, **incident_detail(meta)})

    return route


def incident_detail(meta: dict[str, Any]) -> dict[str, Any]:
    """The summary text and the files (name, bytes) of a listed incident."""
    folder = Path(meta["path"])
    try:
        summary = read_nofollow(folder / SUMMARY).decode(errors="replace")
    except OSError:
        summary = ""
    files = []
    with contextlib.suppress(OSError):
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if entry.is_file(follow_symlinks=False) and not entry.name.startswith("."):
                files.append({"name": entry.name, "bytes": entry.stat(follow_symlinks=False).st_size})
    return {"summary": summary, "files": files}


def find_incident(store: IncidentStore, incident_id: str) -> dict[str, Any]:
    """The incident's metadata. Raises UserError when there is no such incident."""
    for meta in store.list():
        if meta["id"] == incident_id:
            return meta
    raise UserError(f"no incident {incident_id!r} in {store.root}", "see `profagent incidents list`")

"""Incident bundles: when a job hangs or slows down, capture the evidence on every rank.

``IncidentsSource`` runs in the runtime like a source: each tick it reads the job's
state (the ``findings`` snapshot, else stalled ranks from ``stacks``; the ``traces``
snapshot for step-time regressions), asks the pure ``IncidentGate`` whether to capture,
and starts ``Capture`` threads within ``CaptureSlots`` (one per job, one per user, a
global cap), each ended by ``incidents.capture_timeout``. The gate's last captures are
kept in the state folder (``RateLimitFile``) so a restart does not capture the same hang
again. While a trigger lasts, its bundle follows it: a changed diagnosis rewrites the
summary. It publishes ``IncidentsSnapshot`` (counts for ``profagent_incidents_total``,
rate-limited triggers, refused on-demand trace files).

A bundle is one 0700 folder under the agent's state folder (never where users' files
live), written with O_NOFOLLOW|O_EXCL so a planted symlink is never followed:
``incident.json`` (id, kind, job_id, time, path, status), ``stacks-rank<R>.txt``,
``stacks-rank<R>-worker<PID>.txt`` (each DataLoader worker of the rank), ``findings.json``, ``metrics.prom``, ``trace-analysis-rank<R>.json``,
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
from pathlib import Path
from typing import Any

import orjson
import psutil

from profagent.analysis.collectives import parse_dump_text
from profagent.analysis.incidents import (
    KINDS,
    IncidentGate,
    LatestTrace,
    RegressionDetector,
    Retention,
    Stored,
    Trigger,
    diagnosis,
    hang_triggers,
    self_profiling,
    to_remove,
)
from profagent.analysis.stacks import own_frame
from profagent.config import IncidentsConfig, TracesConfig
from profagent.contracts import (
    ROLE_DATALOADER,
    FindingsSnapshot,
    IncidentsSnapshot,
    ProcessInfo,
    ProcessTree,
    StateView,
)
from profagent.errors import SourceUnavailable, UserError
from profagent.exporters.exposition import Exposition
from profagent.sources.ondemand import kineto
from profagent.sources.ondemand.endpoint import NoPollers, TraceTarget
from profagent.sources.stacks import pyspy
from profagent.sources.traces.reader import TraceError, read_trace
from profagent.sources.traces.source import traced_pids
from profagent.sources.traces.watcher import default_state_dir
from profagent.state import State
from profagent.system.cputime import CPU
from profagent.system.safefs import UnsafePath, open_regular

log = logging.getLogger(__name__)

PROBED_EVERY = 30.0  # seconds between two of a rank's probed step times fed to the regression rule
PROBED_MIN_STEPS = 10  # steps in the timeline window for its p50 to count

META = "incident.json"
SUMMARY = "summary.md"
DUMP_TIMEOUT = 20.0  # seconds per py-spy dump attempt (and never past the capture's deadline)
ONDEMAND_TRACE_MS = 1000
RATE_LIMITS = "incidents-rate-limits.json"  # in the agent's state folder: survives restarts
MAX_RATE_LIMITS_BYTES = 1024 * 1024
COPY_CHUNK = 1024 * 1024
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def _over_room(size: int, room: int, config: IncidentsConfig, copied: bool = False) -> str:
    what = f"its compressed copy passed {size} bytes" if copied else f"{size} bytes"
    return (f"{what}, more than the {room} bytes left to this bundle under incidents.max_bytes_per_user "
            f"({config.max_bytes_per_user}) and incidents.max_bytes ({config.max_bytes}); left out, raise them to keep such traces")


def incidents_dir(config: IncidentsConfig, state_dir: str) -> Path:
    """incidents.dir, else <agent state folder>/incidents (/var/lib/profagent/incidents as root)."""
    return Path(config.dir) if config.dir else default_state_dir(state_dir) / "incidents"


def rate_limits_path(state_dir: str) -> Path:
    """<agent state folder>/incidents-rate-limits.json: the captures still inside their period."""
    return default_state_dir(state_dir) / RATE_LIMITS


def retention(config: IncidentsConfig) -> Retention:
    return Retention(config.max_count, config.max_bytes, config.max_count_per_job,
                     config.max_count_per_user, config.max_bytes_per_user)


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

    def prune(self, caps: Retention) -> list[str]:
        """Remove incidents beyond the caps (``to_remove``); returns the ids removed."""
        stored = [Stored(m["id"], _number(m.get("time")), _folder_bytes(Path(m["path"])), str(m.get("job_id", "")),
                         int(_number(m.get("uid"), -1))) for m in self.list()]
        removed = to_remove(stored, caps)
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


def read_nofollow(path: Path, limit: int = 16 * 1024 * 1024) -> bytes:
    """A regular file's bytes (never a symlink followed, never a FIFO waited on); OSError
    past ``limit`` bytes."""
    try:
        fd = open_regular(str(path))
    except UnsafePath as exc:
        raise OSError(f"{path}: {exc}") from None
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path}: more than {limit} bytes")
    return data


def _number(value: Any, default: float = 0.0) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


def _folder_bytes(path: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            with contextlib.suppress(OSError):
                total += entry.stat(follow_symlinks=False).st_size
    return total


# -- the source ------------------------------------------------------------------------------

class RateLimitFile:
    """The gate's last captures, kept across restarts: a 0600 file in the state folder,
    written through a fresh temporary file (O_EXCL|O_NOFOLLOW) and read without following
    a symlink or waiting on a FIFO. A corrupt file is logged in one line and ignored."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()  # captures start from the tick and from control requests

    def load(self) -> dict[tuple[str, str], float]:
        try:
            data = orjson.loads(read_nofollow(self.path, MAX_RATE_LIMITS_BYTES))
            out = {(str(kind), str(job)): float(t) for kind, job, t in data["last"]
                   if kind in KINDS and isinstance(t, int | float)}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, KeyError) as exc:
            log.warning("ignoring the incidents' rate-limit state %s (%s): limits start afresh", self.path, exc)
            return {}
        return out

    def save(self, last: dict[tuple[str, str], float]) -> None:
        entries = sorted(([k, j, t] for (k, j), t in last.items()), key=lambda e: -e[2])
        data = orjson.dumps({"last": entries})
        while len(data) > MAX_RATE_LIMITS_BYTES and entries:  # huge job ids: keep the newest
            entries = entries[: len(entries) // 2]
            data = orjson.dumps({"last": entries})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with self._lock:
                replace_nofollow(self.path, data)
        except OSError as exc:
            log.warning("cannot save the incidents' rate-limit state to %s (%s): a restart forgets it", self.path, exc)


class CaptureSlots:
    """Captures run at once: one per job, at most ``per_user`` per user (the real uid of the
    job's processes) and ``total`` in all, so one user's stalled captures never block
    another user's. Each capture ends by its deadline, which frees its slot."""

    def __init__(self, total: int = 4, per_user: int = 1) -> None:
        self.total = max(1, total)
        self.per_user = max(1, per_user)
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # job -> uid

    def acquire(self, job_id: str, uid: int) -> bool:
        with self._lock:
            if (job_id in self._held or len(self._held) >= self.total
                    or sum(1 for u in self._held.values() if u == uid) >= self.per_user):
                return False
            self._held[job_id] = uid
            return True

    def release(self, job_id: str) -> None:
        with self._lock:
            self._held.pop(job_id, None)

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._held)


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
        slots: CaptureSlots | None = None,
        wall: Callable[[], float] = time.time,
        rate_file: Path | None = None,  # None: rate limits are forgotten on restart
        max_trace_bytes: int = TracesConfig.max_file_bytes,  # traces.max_file_bytes
        uid_of: Callable[[int], int] | None = None,  # PID -> real uid (-1: unknown)
        max_pyspy: int = 16,  # stacks.max_pyspy: dumps at once
    ) -> None:
        self.config = config
        self.store = IncidentStore(root)
        self.state = state
        self.interval = interval
        self.ondemand = ondemand
        self.slots = slots or CaptureSlots(config.max_captures, config.max_captures_per_user)
        self._wall = wall
        self.max_trace_bytes = max_trace_bytes
        self._uid_of = uid_of or _real_uid
        self._uids: dict[tuple[int, float], int] = {}  # (pid, create_time) -> real uid, read once
        self._gate = IncidentGate(config.rate_limit_seconds)
        self._rate_file = RateLimitFile(rate_file) if rate_file is not None else None
        self._regression = RegressionDetector(config.regression_factor, config.regression_seconds)
        # the same rule on the kernel probes' step time: every job, no trace needed
        self._probed = RegressionDetector(config.regression_factor, config.regression_seconds)
        self._probed_at: dict[tuple[str, str], float] = {}  # when each rank's p50 was last fed
        self._lock = threading.Lock()  # the gate and the counts (control requests come from another thread)
        self._counts: dict[tuple[str, str], int] = {}
        self._suppressed: dict[tuple[str, str], int] = {}
        self._rejected: dict[str, int] = {}
        self._open: dict[tuple[str, str], Capture] = {}  # (kind, job) -> its bundle while the trigger lasts
        self._restored: set[tuple[str, str]] = set()  # captured before a restart: may be open again once
        self._threads: set[threading.Thread] = set()
        self._binary: str | None = None
        self.last_error = ""
        self.stopping = threading.Event()
        self._dumps_lock = threading.Lock()
        self._dumps: set[subprocess.Popen] = set()  # running py-spy dumps, killed by stop()
        self._dump_slots = threading.BoundedSemaphore(max_pyspy)  # stacks.max_pyspy dumps at once

    def start(self) -> None:
        try:
            self.store.ensure_root()
        except OSError as exc:
            raise SourceUnavailable(f"cannot use the incidents folder {self.store.root} ({exc}): set incidents.dir") from None
        if self._rate_file is not None:
            restored = self._rate_file.load()
            self._gate.restore(restored, self._wall())
            self._restored = set(restored)
        try:
            self._binary = pyspy.find_pyspy()
        except pyspy.PySpyProblem as exc:
            log.warning("incidents will have no stacks: %s", exc)

    def stop(self) -> None:
        """Abandon running captures: their py-spy dumps are killed (a dump can take many
        seconds under load) and their daemon threads are not waited for beyond a second."""
        self.stopping.set()
        with self._dumps_lock:
            dumps = list(self._dumps)
        pyspy.stop_all(dumps, grace=0.2)
        deadline = time.monotonic() + 1.0
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))

    def run_dump(self, args: list[str], timeout: float = DUMP_TIMEOUT) -> tuple[str, str]:
        """(stdout, first error line) of one py-spy dump; killed and reaped if it overruns
        ``timeout`` or the agent stops. A job of 150 ranks: at most stacks.max_pyspy dumps
        at once, and the wait for a turn counts against ``timeout``."""
        began = time.monotonic()
        if not self._dump_slots.acquire(timeout=max(0.0, timeout)):
            return "", "no py-spy turn before incidents.capture_timeout (stacks.max_pyspy dumps at once)"
        try:
            return self._run_dump(args, timeout - (time.monotonic() - began))
        finally:
            self._dump_slots.release()

    def _run_dump(self, args: list[str], timeout: float) -> tuple[str, str]:
        if self.stopping.is_set():
            return "", "the agent is stopping"
        if timeout <= 0:
            return "", "no time left before incidents.capture_timeout"
        try:
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=pyspy.die_with_parent(), env={**os.environ, "RUST_BACKTRACE": "0"})
        except OSError as exc:
            return "", str(exc)
        with self._dumps_lock:
            self._dumps.add(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            pyspy.stop_all([proc], grace=0.2)
            return "", f"timed out after {timeout:.3g} s"
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
        uids = self._job_uids(tree)
        offered = [t for t in triggers if live.get(t.job_id, True)]
        with self._lock:
            # A slot is taken in busy() itself, which the gate asks only for a trigger it
            # would capture: the capture below then owns that slot.
            decisions = self._gate.offer(
                offered, lambda key: not self.slots.acquire(key[1], uids.get(key[1], -1)), now)
            for d in decisions:
                if d.action == "rate_limited":
                    self._suppressed[d.trigger.key[::-1]] = self._suppressed.get(d.trigger.key[::-1], 0) + 1
                    log.info("incident %s in job %s not captured: rate limit (%g s)",
                             d.trigger.kind, d.trigger.job_id, self.config.rate_limit_seconds)
        for d in decisions:
            if d.action == "capture":
                self._start(d.trigger, tree, now, uids.get(d.trigger.job_id, -1))
            elif d.action == "rate_limited" and d.trigger.kind == "hang":
                self._reopen(d.trigger, tree)
        self._follow(offered)
        with self._lock:  # every series exists from the start, so changes() sees the first incident
            for job_id in live:
                for kind in KINDS:
                    self._counts.setdefault((job_id, kind), 0)
        return self._snapshot(set(live))

    def _follow(self, triggers: list[Trigger]) -> None:
        """Open incidents follow their trigger: a changed diagnosis rewrites the summary;
        a trigger gone closes the incident."""
        current = {t.key: t for t in triggers}
        with self._lock:
            self._open = {k: c for k, c in self._open.items() if k in current}
            following = [(c, current[k]) for k, c in self._open.items()]
        for capture, trigger in following:
            if diagnosis(trigger) != diagnosis(capture.trigger):
                capture.update(trigger, self._wall())

    def _reopen(self, trigger: Trigger, tree: ProcessTree) -> None:
        """The same hang, still on after a restart: the bundle captured before it is open
        again, so it follows the finding as if the agent had never stopped. Only the first
        episode after the restart: a later one is another hang, not that bundle's."""
        with self._lock:
            if trigger.key in self._open or trigger.key not in self._restored:
                return
            self._restored.discard(trigger.key)
        stored = [m for m in self.store.list() if m.get("kind") == trigger.kind
                  and m.get("job_id") == trigger.job_id and m.get("status") == "complete"]
        if not stored:
            return
        capture = Capture.reopen(self, stored[-1], tree)
        if capture is None:
            return
        with self._lock:
            self._open[trigger.key] = capture
        log.info("incident %s is open again: the same %s goes on", capture.folder.name, trigger.kind)

    def _job_uids(self, tree: ProcessTree) -> dict[str, int]:
        """job_id -> real uid of its first rank (or process): whose incidents these are."""
        out: dict[str, int] = {}
        if len(self._uids) > 4096:
            self._uids.clear()
        for p in sorted(tree.processes, key=lambda p: p.role != "main"):
            job = p.job_id or tree.job_id
            if job not in out:
                key = (p.pid, p.create_time)
                if key not in self._uids:
                    self._uids[key] = self._uid_of(p.pid)
                out[job] = self._uids[key]
        return out

    def count_rejected(self, reason: str) -> None:
        with self._lock:
            self._rejected[reason] = self._rejected.get(reason, 0) + 1

    def _snapshot(self, live: set[str]) -> IncidentsSnapshot:
        with self._lock:
            counts = tuple((j, k, n) for (j, k), n in sorted(self._counts.items()) if j in live)
            suppressed = tuple((j, k, n) for (j, k), n in sorted(self._suppressed.items()) if j in live)
            rejected = tuple(sorted(self._rejected.items()))
        return IncidentsSnapshot(counts, suppressed, rejected)

    def _findings(self, view: StateView, now: float) -> FindingsSnapshot:
        snap = view.findings  # published by the findings engine every tick
        return snap if snap is not None else FindingsSnapshot((), now)

    def _regressions(self, view: StateView, tree: ProcessTree, now: float) -> list[Trigger]:
        traces = view.traces
        self._regression.set_baseline(traces.baseline if traces is not None else ())
        for rt in traces.ranks if traces is not None else ():
            if rt.report.step_mean:
                self._regression.observe(rt.job_id or tree.job_id, rt.rank, rt.report.step_mean, rt.ingested_at,
                                         rt.report)
        self._regression.forget(tree.job_status())
        return self._regression.triggers(now) + self._probed_regressions(view, tree, now)

    def _probed_regressions(self, view: StateView, tree: ProcessTree, now: float) -> list[Trigger]:
        """The probes' p50 step time of each rank, one value per PROBED_EVERY seconds (the
        first MIN_BASELINE of them are its baseline): no trace needed."""
        timeline = view.timeline
        for r in timeline.ranks if timeline is not None else ():
            key = (r.job_id, r.rank)
            if r.p50 is not None and r.window_steps >= PROBED_MIN_STEPS \
                    and now - self._probed_at.get(key, float("-inf")) >= PROBED_EVERY:
                self._probed_at[key] = now
                self._probed.observe(r.job_id, r.rank, r.p50, now)
        self._probed.forget(tree.job_status())
        self._probed_at = {k: v for k, v in self._probed_at.items() if k[0] in tree.job_status()}
        return self._probed.triggers(now)

    # -- manual requests (control op "incident") --------------------------------------------
    def request(self, job_id: str | None, reason: str = "") -> dict[str, Any]:
        """Capture now for ``job_id`` (None: the job, when there is one). Reply for the control socket."""
        tree = self.state.tree
        jobs = [j for j, alive in (tree.job_status() if tree else {}).items() if alive]
        job = job_id or (jobs[0] if len(jobs) == 1 else None)
        if tree is None or job is None or job not in jobs:
            return {"ok": False, "error": f"no live job {job_id!r} (jobs: {', '.join(jobs) or 'none'})"}
        now = self._wall()
        uid = self._job_uids(tree).get(job, -1)
        trigger = Trigger("manual", job, None, reason or "requested with `profagent incidents capture`")
        with self._lock:
            action = self._gate.ask(trigger.key, lambda key: not self.slots.acquire(job, uid), now)
            wait = self._gate.retry_after(trigger.key, now)
        if action == "busy":
            return {"ok": False, "error": "busy: a capture of this job (or another of its user's) is running, "
                    "try again in a few seconds"}
        if action == "rate_limited":
            return {"ok": False, "error": f"rate limited: one manual incident per job every {self.config.rate_limit_seconds:g} s "
                    f"(incidents.rate_limit_seconds); next in {wait:.0f} s"}
        path = self._start(trigger, tree, now, uid)
        if path is None:
            return {"ok": False, "error": f"could not start the capture: {self.last_error}"}
        return {"ok": True, "id": path.name, "path": str(path)}

    # -- capture ---------------------------------------------------------------------------
    def _start(self, trigger: Trigger, tree: ProcessTree, now: float, uid: int) -> Path | None:
        """Start a capture in the slot the gate reserved for it."""
        try:
            folder = self.store.create(trigger.kind, trigger.job_id, now)
        except OSError as exc:
            self.slots.release(trigger.job_id)
            self.last_error = str(exc)
            log.warning("cannot create an incident folder under %s: %s", self.store.root, exc)
            return None
        with self._lock:
            key = (trigger.job_id, trigger.kind)
            self._counts[key] = self._counts.get(key, 0) + 1
            if self._rate_file is not None:  # under the lock: saves never go out of order
                self._rate_file.save(self._gate.export(now))
        log.warning("incident %s: %s in job %s (%s); capturing into %s",
                    folder.name, trigger.kind, trigger.job_id, trigger.reason, folder)
        capture = Capture(self, trigger, tree, folder, now, uid)
        if trigger.kind != "manual":
            with self._lock:
                self._open[trigger.key] = capture
        thread = threading.Thread(target=self._capture, args=(capture,), name="profagent-incident", daemon=True)
        self._threads.add(thread)
        thread.start()
        return folder

    def _capture(self, capture: Capture) -> None:
        try:
            with CPU.charge("incidents"):  # its py-spy dumps are reaped by communicate(): not counted
                capture.run()
        except Exception:
            log.exception("incident capture into %s failed", capture.folder)
        finally:
            self.slots.release(capture.trigger.job_id)
            self._threads.discard(threading.current_thread())
            with contextlib.suppress(OSError):
                removed = self.store.prune(retention(self.config))
                if removed:
                    log.info("removed old incidents: %s", ", ".join(removed))


def _real_uid(pid: int) -> int:
    """The real uid of a process (a job cannot fake it as it can the owner of /proc/PID)."""
    try:
        return psutil.Process(pid).uids().real
    except (psutil.Error, OSError):
        return -1


class Capture:
    """One bundle: every rank's stacks (in parallel), the state, traces, then the summary.
    Everything is written by ``incidents.capture_timeout`` whatever the ranks or their files do."""

    def __init__(self, source: IncidentsSource, trigger: Trigger, tree: ProcessTree, folder: Path, now: float,
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
        self.meta = {"id": folder.name, "kind": trigger.kind, "job_id": trigger.job_id, "time": now,
                     "rank": trigger.rank, "reason": trigger.reason, "uid": uid, "status": "capturing"}
        self._lock = threading.Lock()  # the trigger and the summary: updated from the agent's tick
        self._updated: float | None = None
        self._first_reason = trigger.reason

    def run(self) -> None:
        self._write(META, _json(self.meta), replace=True)
        view = self.source.state.view()
        # The stacks before the traces: a native dump stops its rank (0.3-1 s measured, more
        # on a loaded node), and in a trace that pause reads as a slow step of the rank (run
        # 113: a straggler at 2.8x the other rank's step, all of it the agent's own doing).
        dumps = self._dump_all()
        if self.source.stopping.is_set():
            return  # the agent is exiting: incident.json keeps status "capturing"
        request = self._request_traces()
        for info, (text, note) in zip(self.ranks + self.workers, dumps, strict=True):
            if info.role == ROLE_DATALOADER:
                name = f"stacks-rank{_safe(info.rank)}-worker{info.pid}.txt"
                what = f"rank {info.rank}'s DataLoader worker (PID {info.pid})"
            else:
                self.stacks[info.rank] = text
                name, what = f"stacks-rank{_safe(info.rank)}.txt", f"rank {info.rank} (PID {info.pid})"
            self._write(name, (text or f"(no stacks: {note})\n").encode())
            if note:
                self.notes.append(f"{what}: {note}")
        findings = view.findings or FindingsSnapshot((), self.now)
        with self._lock:
            trigger = self._trigger_dict()
        self._write("findings.json", _json({
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
                self._write(f"trace-analysis-rank{_safe(rt.rank)}.json",
                            _json({"ingested_at": rt.ingested_at, **rt.report.to_dict(),
                                   "rank": rt.rank or rt.report.rank}))
        if request is not None:
            self._collect_traces(request)
        with self._lock:
            self._write(SUMMARY, self._summary().encode())
            if self._updated is not None:  # the trigger changed while the capture ran
                self._rewrite_trigger()
            self.meta["status"] = "complete"
            self.meta["completed"] = self.source._wall()
            self.meta["files"] = sorted(self.files)
            self._write(META, _json(self.meta), replace=True)
        log.warning("incident %s captured: %s", self.folder.name, self.folder / SUMMARY)

    @classmethod
    def reopen(cls, source: IncidentsSource, meta: dict[str, Any], tree: ProcessTree) -> Capture | None:
        """A complete bundle, read back from its folder (a restart): its stacks, files and
        notes, with the trigger it last said. None if it cannot be read."""
        folder = Path(meta["path"])
        try:
            said = json.loads(read_nofollow(folder / "findings.json"))["trigger"]
            summary = read_nofollow(folder / SUMMARY).decode(errors="replace")
            trigger = Trigger(str(said["kind"]), str(said["job_id"]), said.get("rank"), str(said.get("reason", "")),
                              dict(said.get("evidence") or {}))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        capture = cls(source, trigger, tree, folder, _number(meta.get("time")), int(_number(meta.get("uid"), -1)))
        capture.meta = {k: v for k, v in meta.items() if k != "path"}
        capture.files = [str(f) for f in meta.get("files") or ()]
        for info in capture.ranks:
            with contextlib.suppress(OSError):
                capture.stacks[info.rank] = read_nofollow(folder / f"stacks-rank{_safe(info.rank)}.txt").decode(errors="replace")
        notes = summary.split("\n## Notes\n", 1)
        capture.notes = [line[2:] for line in notes[1].splitlines() if line.startswith("- ")] if len(notes) == 2 else []
        first = re.search(r"it first said: (.*)\)$", summary, re.M)
        capture._first_reason = first.group(1) if first else trigger.reason
        return capture

    def update(self, trigger: Trigger, now: float) -> None:
        """The finding that caused the incident changed while it is open: from now on the
        summary (rewritten at once if already written) and incident.json say the new one."""
        with self._lock:
            self.trigger = trigger
            self._updated = now
            self.meta.update(rank=trigger.rank, reason=trigger.reason, updated=now)
            if self.meta["status"] != "complete":
                return  # run() writes the summary from the new trigger
            try:
                self._write(SUMMARY, self._summary().encode(), replace=True)
                self._write(META, _json(self.meta), replace=True)
                self._rewrite_trigger()
            except (OSError, ValueError) as exc:  # the bundle was removed meanwhile (retention)
                log.info("cannot update incident %s: %s", self.folder.name, exc)
                return
        log.warning("incident %s updated: %s", self.folder.name, trigger.reason)

    def _rewrite_trigger(self) -> None:
        """findings.json says the trigger as it is now; the one it was captured on stays as
        ``first_trigger``, the job's findings as they were at the capture."""
        saved = json.loads(read_nofollow(self.folder / "findings.json"))
        saved.setdefault("first_trigger", saved.get("trigger"))
        saved["trigger"] = self._trigger_dict()
        self._write("findings.json", _json(saved), replace=True)

    def _trigger_dict(self) -> dict[str, Any]:
        t = self.trigger
        return {"kind": t.kind, "job_id": t.job_id, "rank": t.rank, "reason": t.reason, "evidence": dict(t.evidence)}

    def _remaining(self) -> float:
        return self.deadline - time.monotonic()

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
        binary = self.source._binary
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

    def _collect_traces(self, request: Any) -> None:
        rank_of = {p.pid: p.rank for p in self.ranks}
        uid_of = {p.pid: self.source._uid_of(p.pid) for p in self.ranks}
        waiting = dict(request.targets)
        seen: dict[int, tuple[int, int, int]] = {}  # pid -> (inode, size, mtime) of the last look
        refused: dict[int, str] = {}
        while waiting and self._remaining() > 0 and not self.source.stopping.is_set():
            for pid, target in list(waiting.items()):
                name = f"trace-rank{_safe(rank_of.get(pid, str(pid)))}.pt.trace.json.gz"
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
        now = self.source._wall()  # the ranks went on writing their own traces during the capture
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
        bundle of that user and still be over (a 1.57 GB trace was copied against 192 MiB)."""
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
                f"earlier, analysed in trace-analysis-rank{_safe(t.rank)}.json), and libkineto runs one profiler at a time")

    def _self_profiling(self, now: float) -> dict[str, LatestTrace]:
        traces = self.source.state.view().traces
        latest = [LatestTrace(rt.job_id, rt.rank, rt.report.path, traced_pids(rt.report, rt.report.path)[1],
                              rt.ingested_at) for rt in (traces.ranks if traces is not None else ())]
        return self_profiling(latest, self.trigger.job_id, now)

    # -- summary -------------------------------------------------------------------------
    def _summary(self) -> str:
        """The first page: what the trigger says now, and the culprit's line from this
        bundle's own stacks (never from the tick the capture started on)."""
        t = self.trigger
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.now))
        by_rank = {p.rank: p for p in self.ranks}
        rank = t.rank if t.rank in by_rank else None
        culprits = [r for r in (str(c) for c in t.evidence.get("culprit_ranks") or ()) if r in by_rank]
        where = innermost_frame(self.stacks.get(rank, "")) if rank is not None else None
        title = {"hang": "a rank hangs", "regression": "step time regressed", "manual": "capture on request"}[t.kind]
        if rank in by_rank:
            which = f"rank {rank} (PID {by_rank[rank].pid})"
            own = own_line(self.stacks.get(rank, ""))
            line = (f"`{own}` (its own code), in `{where}` (innermost Python frame of its main thread)"
                    if own and where and own != where
                    else f"`{where}` (innermost Python frame of its main thread)" if where else "unknown (no stacks)")
        else:
            which = f"rank {t.rank} (not on this node)" if t.rank is not None else "the whole job"
            line = "unknown (no stacks of that rank)" if t.rank is not None else "each rank's below"
        lines = [f"# Incident {self.folder.name}: {title} (job {t.job_id})", "",
                 f"- **What happened**: {t.reason}", f"- **When**: {when}"]
        if self._updated is not None:
            lines.append(f"- **Updated**: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(self._updated))}, "
                         f"when the finding changed (it first said: {self._first_reason})")
        lines += [f"- **Which rank**: {which}", f"- **Which line**: {line}"]
        if t.evidence.get("advice"):
            lines.append(f"- **What to do**: {t.evidence['advice']}")
        for other in culprits:
            if other != rank:
                frame = innermost_frame(self.stacks.get(other, ""))
                lines.append(f"- **Also culprit**: rank {other} (PID {by_rank[other].pid}) at {f'`{frame}`' if frame else 'an unknown line'}")
        lines += ["", "## Every rank", "",
                  "| rank | PID | its own line (main thread) | innermost Python frame of the main thread |",
                  "| --- | --- | --- | --- |"]
        for p in self.ranks:
            dump = self.stacks.get(p.rank, "")
            frame, own = innermost_frame(dump), own_line(dump)
            lines.append(f"| {p.rank} | {p.pid} | {f'`{own}`' if own else '-'} | {f'`{frame}`' if frame else '-'} |")
        if self.workers:
            lines += ["", "## DataLoader workers", "", "| rank | PID | its own line | file |", "| --- | --- | --- | --- |"]
            for p in self.workers:
                lines.append(f"| {p.rank} | {p.pid} | {_worker_line(self.folder, p)} | "
                             f"`stacks-rank{_safe(p.rank)}-worker{p.pid}.txt` |")
        evidence = dict(t.evidence)
        if evidence:
            lines += ["", "## Evidence", "", "```json", json.dumps(evidence, indent=2, default=str), "```"]
        lines += ["", "## Files", ""] + [f"- `{name}`" for name in sorted(self.files)]
        if self.notes:
            lines += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


_FRAME = re.compile(r"^\s+(\S.*?) \((\S+\.py):(\d+)\)\s*$")
# py-spy's thread line: 'Thread 4242 (idle): "MainThread"', 'Thread 0x7F.. (active+gil): "x"'.
_THREAD = re.compile(r'^Thread \S+ \(([^)]*)\): "(.*)"\s*$')


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


def own_line(dump: str) -> str | None:
    """``function (file.py:line)`` of the main thread's innermost frame of the job's own code
    (not the standard library's, torch's or another framework's) in a py-spy text dump."""
    threads = parse_dump_text(dump)
    main = next((t for t in threads if t.name == "MainThread"), threads[0] if threads else None)
    frame = own_frame(main.frames) if main is not None else None
    return str(frame) if frame is not None else None


def _worker_line(folder: Path, p: ProcessInfo) -> str:
    try:
        dump = read_nofollow(folder / f"stacks-rank{_safe(p.rank)}-worker{p.pid}.txt").decode(errors="replace")
    except OSError:
        return "-"
    own = own_line(dump)
    return f"`{own}`" if own else "-"


def _json(data: Any) -> bytes:
    return json.dumps(data, indent=2, default=str).encode() + b"\n"


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

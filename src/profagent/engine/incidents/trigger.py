"""When to capture: ``IncidentsSource`` runs in the runtime like a source.

Each tick it reads the job's state (the ``findings`` snapshot, else stalled ranks from
``stacks``; the ``traces`` and ``timeline`` snapshots for step-time regressions), asks the
pure ``IncidentGate`` whether to capture, and starts ``Capture`` threads within
``CaptureSlots`` (one per job, one per user, a global cap). The gate's last captures are
kept in the state folder (``RateLimitFile``) so a restart does not capture the same hang
again. While a trigger lasts, its bundle follows it. It publishes ``IncidentsSnapshot``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from profagent.analysis.incidents import (
    TRIGGER_KINDS,
    IncidentGate,
    RegressionDetector,
    Trigger,
    diagnosis,
    hang_triggers,
)
from profagent.config import IncidentsConfig, TracesConfig
from profagent.contracts import FindingsSnapshot, IncidentsSnapshot, ProcessTree, StateView
from profagent.engine.incidents.capture import DUMP_TIMEOUT, Capture
from profagent.engine.incidents.store import IncidentStore, RateLimitFile, retention
from profagent.errors import SourceUnavailable
from profagent.sources.stacks import pyspy
from profagent.state import State
from profagent.system.cputime import CPU

log = logging.getLogger(__name__)

# A rank's probed p50 is fed to the regression rule once every half timeline window (30 s
# at the default 60): each value covers the window, so two in a row share half their steps.
PROBED_EVERY = 0.5  # of timeline.window_seconds
PROBED_MIN_STEPS = 10  # steps in the timeline window for its p50 to count


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
        timeline: Any = None,  # the TimelineSource, for the picture of the steps before the trigger
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
        self.timeline = timeline
        self.slots = slots or CaptureSlots(config.max_captures, config.max_captures_per_user)
        self.wall = wall
        self.max_trace_bytes = max_trace_bytes
        self.uid_of = uid_of or _real_uid
        self._uids: dict[tuple[int, float], int] = {}  # (pid, create_time) -> real uid, read once
        self._gate = IncidentGate(config.rate_limit_seconds)
        self._rate_file = RateLimitFile(rate_file) if rate_file is not None else None
        self._regression = RegressionDetector(config.regression_factor, config.regression_seconds)
        # the same rule on the kernel probes' step time: every job, no trace needed
        self._probed = RegressionDetector(config.regression_factor, config.regression_seconds,
                                          measured_by="kernel probes, no trace")
        self._probed_at: dict[tuple[str, str], float] = {}  # when each rank's p50 was last fed
        self._lock = threading.Lock()  # the gate and the counts (control requests come from another thread)
        self._counts: dict[tuple[str, str], int] = {}
        self._suppressed: dict[tuple[str, str], int] = {}
        self._rejected: dict[str, int] = {}
        self._open: dict[tuple[str, str], Capture] = {}  # (kind, job) -> its bundle while the trigger lasts
        self._restored: set[tuple[str, str]] = set()  # captured before a restart: may be open again once
        self._threads: set[threading.Thread] = set()
        self.pyspy_binary: str | None = None
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
            self._gate.restore(restored, self.wall())
            self._restored = set(restored)
        try:
            self.pyspy_binary = pyspy.find_pyspy()
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
            proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=pyspy.die_with_parent(), env={**os.environ, "RUST_BACKTRACE": "0"})
        except OSError as exc:
            return "", str(exc)
        with self._dumps_lock:
            self._dumps.add(proc)
        try:
            got = pyspy.communicate_capped(proc, timeout)
        except subprocess.TimeoutExpired:
            pyspy.stop_all([proc], grace=0.2)
            return "", f"timed out after {timeout:.3g} s"
        finally:
            with self._dumps_lock:
                self._dumps.discard(proc)
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        if self.stopping.is_set():
            return "", "the agent is stopping"
        if proc.returncode == 0 and "Thread " in got.out:
            if got.truncated:
                return got.out + (f"\n(truncated: py-spy printed {got.truncated} more bytes, over the "
                                  f"{pyspy.MAX_DUMP_TEXT >> 20} MiB kept of one dump)\n"), ""
            return got.out, ""
        return "", pyspy.first_line(got.err or got.out)

    def collect(self, tree: ProcessTree) -> IncidentsSnapshot:
        view = self.state.view()
        now = self.wall()
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
                for kind in TRIGGER_KINDS:
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
                capture.update(trigger, self.wall())

    def _reopen(self, trigger: Trigger, tree: ProcessTree) -> None:
        """The same hang, still on after a restart: the bundle captured before it is open
        again, so it follows the finding as if the agent had never stopped. Only the first
        episode after the restart: a later one is another hang, not that bundle's."""
        with self._lock:
            if trigger.key in self._open or trigger.key not in self._restored:
                return
            self._restored.discard(trigger.key)
        stored = [m for m in self.store.list() if m.kind == trigger.kind
                  and m.job_id == trigger.job_id and m.status == "complete"]
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
                    self._uids[key] = self.uid_of(p.pid)
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
        """The probes' p50 step time of each rank, one value per half timeline window (the
        first MIN_BASELINE of them are its baseline): no trace needed."""
        timeline = view.timeline
        every = PROBED_EVERY * timeline.window_seconds if timeline is not None else 0.0
        for r in timeline.ranks if timeline is not None else ():
            key = (r.job_id, r.rank)
            if r.p50 is not None and r.window_steps >= PROBED_MIN_STEPS \
                    and now - self._probed_at.get(key, float("-inf")) >= every:
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
        now = self.wall()
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

"""The py-spy sampler thread: back-to-back record windows and periodic dumps per process.

One thread for all the sampled processes, at most ``stacks.max_pyspy`` py-spy children at
once, each with a deadline (the comment above ``Sampler``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from profagent.analysis.stacks import (
    MAX_STACKS,
    MAX_WINDOW_CHARS,
    Place,
    Sample,
    fold_capped,
    idle_places,
    main_thread_sample,
    thread_states,
)
from profagent.config import StacksConfig
from profagent.sources.stacks import pyspy
from profagent.system.childwait import ChildWaiter
from profagent.system.cputime import CPU, reap
from profagent.system.procfs import PROC, exited, start_ticks

log = logging.getLogger(__name__)

POLL = 0.1  # shortest sleep; the check interval where pidfds are missing (each check costs the agent CPU)
MAX_WAIT = 1.0  # longest sleep with no child ending and nothing due
RETRY_AFTER = 5.0  # seconds before sampling a process again after py-spy failed on it,
RETRY_MAX = 300.0  # doubling on each consecutive failure up to this
MAX_PENDING = 1000  # results kept until drained
MAX_PENDING_CHARS = 32 << 20  # characters of stacks in the results kept until drained (the oldest go first)
MAX_OUTPUT_LINE = 8 << 20  # bytes of one line of py-spy output read; a longer line is skipped
MAX_OUTPUT_BYTES = 64 << 20  # bytes of one py-spy output read (only what the caps keep is held)
CUT_GRACE = 2.0  # seconds a window cut short has to stop on SIGINT (py-spy checks once a sample) before SIGKILL
TORN_READS_TOLERATED = 3  # consecutive torn non-blocking reads retried at once, unreported
DEADLINE_SLACK = 10.0  # seconds a record window may run past its --duration (attach, writing) before it is killed
DUMP_DEADLINE = 10.0  # seconds a dump may take (one takes ~10 ms; seconds on a loaded node)
LATE_RUNS_BEFORE_SKIP = 3  # consecutive runs killed at their deadline before the process is skipped
MAX_DUMP_BYTES = 8 << 20  # bytes of a dump's JSON read; a longer one counts as reason parse
MAX_STDERR = 64 << 10  # bytes of py-spy's stderr read (only its first line is used)
STATE_EVERY = 15.0  # seconds between thread-state dumps per process (a dump costs ~10 ms CPU)
# py-spy output folders: profagent-stacks-<agent pid>-<agent start, ms>-<random>. The creator
# is in the name so a later agent can remove the folders of one that was SIGKILLed.
TMP_PREFIX = "profagent-stacks-"
_TMP_NAME = re.compile(re.escape(TMP_PREFIX) + r"(\d+)-(\d+)-")


@dataclass
class PySpyChild:
    """A running py-spy child (a record window or a dump) and where its output goes."""

    kind: str  # "record" or "dump"
    pid: int
    rank: str
    role: str
    proc: subprocess.Popen
    out: Path
    err: Path
    start: float
    wall_start: float
    stopped_before: bool = False  # in state T before py-spy started: not ours to SIGCONT
    born: int | None = None  # the target's start time (clock ticks): tells a reused PID
    native: bool = False  # a blocking --native window
    pidfd: int | None = None  # readable once py-spy exits (None: no pidfds here, poll)
    window: int = 0  # a record window's seconds (0: a dump)
    cut_at: float | None = None  # asked to stop early (SIGINT): its process is wanted at a faster pace now
    deadline: float = float("inf")  # killed if still running then
    late: bool = False  # killed at its deadline


@dataclass(frozen=True)
class Result:
    """One finished py-spy run: samples (record), thread states (dump) or an error."""

    kind: str
    pid: int
    rank: str
    role: str
    start: float
    end: float
    wall_end: float
    samples: tuple[Sample, ...] = ()
    states: dict[tuple[str, str], int] = field(default_factory=dict)  # (state, gil) -> threads
    idle: frozenset[Place] = frozenset()  # dump: leaf lines of the threads seen idle
    error: str = ""  # bounded reason, "" when fine
    detail: str = ""
    native: bool = False  # a record window with native frames (py-spy --native)


# One thread for all the sampled processes: it sleeps until a py-spy child exits (a pidfd),
# a run is due, or the owner changes the targets, at most MAX_WAIT seconds; then it reaps
# finished py-spy children, parses their output into ``Result``s, and starts what is due:
# the next ``record`` window at once, a ``dump --json`` every STATE_EVERY seconds. A py-spy that
# fails on a process is retried after RETRY_AFTER seconds, doubling up to RETRY_MAX. The owner
# sets each process' pace (``set_pace``); a window longer than its process' new pace is cut
# short, so a job that needs the full pace (a stall suspected) gets it at once.
# The owner sets the processes with ``set_targets`` and takes results with ``drain``.
#
# At most ``stacks.max_pyspy`` children run at once, whatever the number of ranks (a job
# of 150 ranks would otherwise get 300 root py-spy processes). Runs that are due wait
# their turn, least recently started first, so every rank is sampled in rotation; each
# wait is counted once, as an error with reason ``pyspy_cap``.
#
# Every run has a deadline: a record window its seconds + DEADLINE_SLACK, a dump
# DUMP_DEADLINE. A py-spy still there then is killed (it may be blocked in an ``open()``
# of a file the target's owner planted, or reading a process that hides its interpreter),
# counted as ``pyspy_deadline``, and its slot is free again; the process is retried with
# the usual back-off, and after LATE_RUNS_BEFORE_SKIP such runs in a row it is skipped
# (``pyspy_skipped``, logged once) until it exits. Before each run the target's interpreter
# files are checked (``pyspy.unsafe_interpreter``): a process whose mapped Python is
# deleted, or not a regular file, is skipped the same way (``unsafe_target``).
class Sampler:
    def __init__(
        self,
        binary: str,
        config: StacksConfig,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._binary = binary
        self.config = config
        self._clock, self._wall = clock, wall
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tmp: Path | None = None
        self._wanted: dict[int, tuple[str, str]] = {}  # pid -> (rank, role)
        self._pace: dict[int, tuple[int, float]] = {}  # pid -> (rate, window) of its next record window
        self._children: dict[tuple[str, int], PySpyChild] = {}  # (kind, pid) -> running child
        self._next: dict[tuple[str, int], float] = {}  # (kind, pid) -> earliest next start
        self._fails: dict[tuple[str, int], int] = {}  # (kind, pid) -> consecutive failures
        self._started: dict[tuple[str, int], float] = {}  # (kind, pid) -> when its last run started
        self._deferred: set[tuple[str, int]] = set()  # due, waiting for a slot under max_pyspy
        self._results: list[Result] = []
        self._seq = 0
        self._native: set[int] = set()  # pids whose next record window is native
        self._late: dict[int, int] = {}  # pid -> consecutive runs killed at their deadline
        self._skipped: dict[int, str] = {}  # pid -> why it is not sampled any more (until it leaves)
        self._waiter = ChildWaiter()

    def start(self) -> None:
        me = psutil.Process()
        remove_stale_folders(Path(tempfile.gettempdir()), me.create_time())
        self._tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{me.pid}-{_ms(me.create_time())}-"))
        self._thread = threading.Thread(target=self._run, name="profagent-pyspy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Every py-spy child is gone when this returns (< 1 s)."""
        self._stop.set()
        self._waiter.wake()
        if self._thread is not None:
            self._thread.join(1.0)
        with self._lock:
            children = list(self._children.values())
            self._children.clear()
        pyspy.stop_all([j.proc for j in children])  # the thread normally did it already
        for j in children:
            ChildWaiter.forget(j.pidfd)
        if self._thread is None or not self._thread.is_alive():
            self._waiter.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def set_targets(self, wanted: dict[int, tuple[str, str]]) -> None:
        """The processes to sample: pid -> (rank, role)."""
        with self._lock:
            changed = wanted.keys() != self._wanted.keys()
            self._wanted = dict(wanted)
        if changed:
            self._waiter.wake()  # a new process is due at once

    def set_pace(self, pace: dict[int, tuple[int, float]]) -> None:
        """(samples per second, window seconds) of each process' next record windows;
        a process not named gets the full rate (``config.rate``, ``config.window``). A
        window running longer than its process' new one is cut short (see _cut_slow_windows)."""
        with self._lock:
            changed, self._pace = pace != self._pace, dict(pace)
        if changed:
            self._waiter.wake()

    def request_native(self, pid: int) -> None:
        """Make the next record window of ``pid`` a native one (C/C++ frames too)."""
        with self._lock:
            self._native.add(pid)
        self._waiter.wake()

    def drain(self) -> list[Result]:
        """Results finished since the last call, oldest first."""
        with self._lock:
            results, self._results = self._results, []
        return results

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    with CPU.charge("stacks"):
                        self._step()
                        pidfds, timeout = self._sleep_plan()
                except Exception as exc:  # keep sampling; the error is counted and logged once
                    with self._lock:
                        self._results.append(Result("record", 0, "", "", 0.0, 0.0, 0.0, error=type(exc).__name__, detail=str(exc)))
                    log.debug("stacks sampler step failed", exc_info=True)
                    pidfds, timeout = [], POLL
                if not self._stop.is_set():
                    self._waiter.wait(pidfds, timeout)
        finally:
            with self._lock:
                children = list(self._children.values())
                self._children.clear()
            pyspy.stop_all([j.proc for j in children])
            for j in children:
                ChildWaiter.forget(j.pidfd)
                if j.native or not self.config.nonblocking:
                    pyspy.resume_if_stopped(j.pid, j.stopped_before)

    def _step(self) -> None:
        with self._lock:
            wanted = dict(self._wanted)
            children = dict(self._children)
        now = self._clock()
        done = []
        self._cut_slow_windows(children)
        self._kill_late(children)
        for key, child in list(children.items()):
            child_cpu = reap(child.proc)  # wait4, not poll(): py-spy's own CPU is the stacks source's cost
            if child_cpu is not None:
                CPU.add_child("stacks", child_cpu)
                ChildWaiter.forget(child.pidfd)
                done.extend(self._harvest(child, now))
                del children[key]
        due = [(kind, pid) for pid in wanted for kind in ("record", "dump")
               if (kind, pid) not in children and pid not in self._skipped and now >= self._next.get((kind, pid), 0.0)]
        due.sort(key=lambda k: self._started.get(k, float("-inf")))  # least recently started first
        for key in due:
            kind, pid = key
            rank, role = wanted[pid]
            if pid in self._skipped or exited(PROC, pid):
                continue  # refused in this step, or gone (exiting, a zombie) since the last tree
            if len(children) >= self.config.max_pyspy:
                if key not in self._deferred:
                    self._deferred.add(key)
                    done.append(Result(kind, pid, rank, role, now, now, self._wall(), error="pyspy_cap",
                                       detail=f"{self.config.max_pyspy} py-spy already running (stacks.max_pyspy): "
                                              "ranks are sampled in turn"))
                continue
            self._deferred.discard(key)
            problem = pyspy.unsafe_interpreter(pid)
            if problem is not None:
                self._skipped[pid] = problem
                done.append(Result(kind, pid, rank, role, now, now, self._wall(), error="unsafe_target",
                                   detail=f"PID {pid} skipped: {problem}"))
                continue
            child = self._launch(kind, pid, rank, role, now)
            if child is not None:
                children[key] = child
                self._started[key] = now
        for table in (self._next, self._fails, self._started):
            for key in [k for k in table if k[1] not in wanted]:
                del table[key]
        self._deferred = {k for k in self._deferred if k[1] in wanted}
        for table in (self._late, self._skipped):
            for pid in [p for p in table if p not in wanted]:
                del table[pid]
        with self._lock:
            self._native &= set(wanted)  # a native window asked of a process no longer sampled
        with self._lock:
            self._children = children
            self._results.extend(done)
            del self._results[:-MAX_PENDING]  # nobody drains while the target is gone
            _trim(self._results)

    def _window(self, pid: int) -> tuple[int, int]:
        """(rate, whole seconds) of ``pid``'s next record window."""
        with self._lock:
            rate, seconds = self._pace.get(pid, (self.config.rate, self.config.window))
        return rate, max(1, round(seconds))

    def _cut_slow_windows(self, children: dict[tuple[str, int], PySpyChild]) -> None:
        """Stop early each record window longer than its process' pace now allows: a steady
        window (20 s) still running when a stall is suspected in its job would otherwise hold
        that rank's next look, and any native window asked of it, until it ends. py-spy stops
        on SIGINT within a sample and writes what it has: a shorter window, harvested as usual.
        A py-spy still there CUT_GRACE later is killed: SIGINT is lost when it comes before
        py-spy set its handler in a process that ignores SIGINT (inherited from an agent
        that a shell started in the background, as `cmd &` does).
        Here, in the thread that reaps: the child cannot have been reaped, so its PID is ours."""
        now = self._clock()
        for child in children.values():
            if child.kind != "record":
                continue
            if child.cut_at is None and child.window > self._window(child.pid)[1]:
                child.cut_at = now
                log.debug("stacks: PID %d: its %d s window cut short for a faster pace", child.pid, child.window)
                pyspy.interrupt(child.proc)
            elif child.cut_at is not None and now - child.cut_at >= CUT_GRACE:
                pyspy.interrupt(child.proc, signal.SIGKILL)  # its samples are lost; the next window is not

    def _kill_late(self, children: dict[tuple[str, int], PySpyChild]) -> None:
        """SIGKILL each child past its deadline; it is reaped (and counted) on a next step,
        which its pidfd wakes at once. Here, in the thread that reaps: its PID is ours."""
        now = self._clock()
        for child in children.values():
            if not child.late and now >= child.deadline:
                child.late = True
                log.debug("stacks: py-spy %s on PID %d past its deadline: killed", child.kind, child.pid)
                pyspy.interrupt(child.proc, signal.SIGKILL)

    def _launch(self, kind: str, pid: int, rank: str, role: str, now: float) -> PySpyChild | None:
        assert self._tmp is not None and self._binary is not None
        self._seq += 1
        out = self._tmp / f"{kind}-{pid}-{self._seq}.out"
        err = self._tmp / f"{kind}-{pid}-{self._seq}.err"
        rate, window = self._window(pid)
        native = False
        if kind == "record":
            with self._lock:
                native = pid in self._native
                self._native.discard(pid)
            args = pyspy.record_args(self._binary, pid, window, rate, "raw", out, self.config.nonblocking,
                                     native=native)
        else:
            args = pyspy.dump_args(self._binary, pid, True)  # states need no consistent stack
            self._next[(kind, pid)] = now + max(window, STATE_EVERY)
        stopped_before = pyspy.is_stopped(pid)
        born = start_ticks(PROC, pid)
        try:
            proc = pyspy.spawn(args, err, stdout_path=out if kind == "dump" else None)
        except OSError as exc:
            self._next[(kind, pid)] = now + RETRY_AFTER
            with self._lock:
                self._results.append(Result(kind, pid, rank, role, now, now, self._wall(), error="spawn", detail=str(exc),
                                            native=native))
            return None
        deadline = now + (window + DEADLINE_SLACK if kind == "record" else DUMP_DEADLINE)
        return PySpyChild(kind, pid, rank, role, proc, out, err, now, self._wall(), stopped_before, born, native,
                          ChildWaiter.watch(proc.pid), window=window if kind == "record" else 0, deadline=deadline)

    def _sleep_plan(self) -> tuple[list[int], float]:
        """What to wait on after a step: the running children's pidfds, and for how long.

        Until the next run is due, within [POLL, MAX_WAIT]. A run deferred by the
        ``max_pyspy`` cap waits for a child to end (its pidfd wakes us); a process that
        was due but exiting is looked at again after POLL. Without pidfds: POLL.
        """
        with self._lock:
            children = dict(self._children)
            wanted = list(self._wanted)
        if any(child.pidfd is None for child in children.values()):
            return [], POLL
        capped = len(children) >= self.config.max_pyspy
        due = [self._next.get((kind, pid), 0.0) for pid in wanted for kind in ("record", "dump")
               if (kind, pid) not in children and not (capped and (kind, pid) in self._deferred)]
        due += [c.deadline for c in children.values() if not c.late]
        timeout = MAX_WAIT if not due else min(MAX_WAIT, max(POLL, min(due) - self._clock()))
        return [c.pidfd for c in children.values() if c.pidfd is not None], timeout

    def _harvest(self, child: PySpyChild, now: float) -> list[Result]:
        try:
            return self._results_of(child, now)
        finally:
            for path in (child.out, child.err):
                path.unlink(missing_ok=True)

    def _results_of(self, child: PySpyChild, now: float) -> list[Result]:
        # a record's output is read line by line at the end, within caps; a dump's JSON is small
        text = _read(child.out, MAX_DUMP_BYTES) if child.kind == "dump" else _head(child.out)
        stderr = _read(child.err, MAX_STDERR)
        base = dict(kind=child.kind, pid=child.pid, rank=child.rank, role=child.role, start=child.start, end=now,
                    wall_end=self._wall(), native=child.native)
        extra = []
        if (child.native or not self.config.nonblocking) and pyspy.resume_if_stopped(child.pid, child.stopped_before):
            detail = f"PID {child.pid} was left stopped after a blocking py-spy sample: resumed it with SIGCONT"
            extra.append(Result(**base, error="target_resumed", detail=detail))
        key = (child.kind, child.pid)
        if child.late:
            return [*extra, *self._late_run(child, key, base, now)]
        self._late.pop(child.pid, None)
        if child.cut_at is not None and not text.strip():  # cut before it sampled (SIGINT while py-spy attached): not a failure
            self._next[key] = now
            if child.native:
                with self._lock:
                    self._native.add(child.pid)  # the native window asked for is still owed
            return extra
        if child.proc.returncode != 0 and not text.strip() and child.native:
            # a native window that failed (no symbols, unwinding refused): plain windows go on at once
            reason = pyspy.failure_reason(stderr, child.pid)
            self._next[key] = now
            return [*extra, Result(**base, error="target_gone" if reason == "target_gone" else "native_failed",
                                   detail=pyspy.first_line(stderr))]
        if child.proc.returncode != 0 and not text.strip():
            reason = pyspy.failure_reason(stderr, child.pid, child.born)
            fails = self._fails[key] = self._fails.get(key, 0) + 1
            detail = pyspy.first_line(stderr)
            if reason == "torn_read":
                if fails < TORN_READS_TOLERATED:
                    self._next[key] = now  # a race, not a failure: read again on the next poll
                    return extra
                reason, detail = "pyspy_failed", f"{fails} torn reads in a row: {detail}"
            self._next[key] = now + min(RETRY_AFTER * 2 ** (fails - 1), RETRY_MAX)
            return [*extra, Result(**base, error=reason, detail=detail)]
        self._fails.pop(key, None)
        if child.kind == "dump":
            try:
                dump = json.loads(text)
                main = main_thread_sample(dump, child.pid)
                return [*extra, Result(**base, states=thread_states(dump), samples=(main,) if main else (),
                                       idle=idle_places(dump))]
            except ValueError:
                detail = "py-spy dump printed invalid JSON" if len(text) < MAX_DUMP_BYTES else \
                    f"py-spy dump printed more than {MAX_DUMP_BYTES >> 20} MiB: not read"
                return [*extra, Result(**base, error="parse", detail=detail)]
        folded = fold_capped(_lines(child.out), child.pid)
        result = Result(**base, samples=tuple(folded.samples))
        if folded.dropped_stacks:
            detail = (f"a window of PID {child.pid} had more stacks than are kept (stacks capped: {MAX_STACKS} "
                      f"distinct, {MAX_WINDOW_CHARS >> 20} MiB of names per window); the rest was dropped")
            return [*extra, result, Result(**base, error="stacks_capped", detail=detail)]
        return [*extra, result]

    def _late_run(self, child: PySpyChild, key: tuple[str, int], base: dict, now: float) -> list[Result]:
        """A run killed at its deadline: counted, retried with the back-off, and after
        LATE_RUNS_BEFORE_SKIP in a row its process is skipped until it exits."""
        if child.native:
            with self._lock:
                self._native.discard(child.pid)
        if exited(PROC, child.pid, child.born):
            return []
        fails = self._fails[key] = self._fails.get(key, 0) + 1
        late = self._late[child.pid] = self._late.get(child.pid, 0) + 1
        self._next[key] = now + min(RETRY_AFTER * 2 ** (fails - 1), RETRY_MAX)
        seconds = child.deadline - child.start
        results = [Result(**base, error="pyspy_deadline",
                          detail=f"py-spy {child.kind} ran past its {seconds:.0f} s deadline: killed")]
        if late >= LATE_RUNS_BEFORE_SKIP and child.pid not in self._skipped:  # (the other kind's run may end later)
            self._skipped[child.pid] = f"{late} py-spy runs in a row killed at their deadline"
            results.append(Result(**base, error="pyspy_skipped",
                                  detail=f"PID {child.pid} skipped until it exits: {self._skipped[child.pid]}"))
        return results


def _trim(results: list[Result]) -> None:
    """Drop the oldest results while those kept hold more than MAX_PENDING_CHARS of stacks."""
    total = 0
    for i in range(len(results) - 1, -1, -1):
        total += sum(len(s.folded) for s in results[i].samples)
        if total > MAX_PENDING_CHARS:
            del results[: i + 1]
            return


def _ms(create_time: float) -> int:
    return round(create_time * 1000)


def remove_stale_folders(tmp: Path, started: float) -> list[Path]:
    """Remove the py-spy folders of agents that died without cleaning up (SIGKILL, OOM):
    only plain folders owned by us, older than this agent, whose creator (PID and start
    time, from the name) is gone. Returns what was removed."""
    removed = []
    try:
        names = [e.name for e in os.scandir(tmp) if e.name.startswith(TMP_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = tmp / name
        match = _TMP_NAME.match(name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if match is None or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mtime >= started:
            continue
        pid, born = int(match.group(1)), int(match.group(2))
        try:
            if _ms(psutil.Process(pid).create_time()) == born:
                continue  # its agent is alive
        except psutil.Error:
            pass  # gone: a reused PID has another start time
        shutil.rmtree(path, ignore_errors=True)  # fd-based: does not follow symlinks inside
        removed.append(path)
    if removed:
        log.info("removed %d py-spy folder(s) left by agents that were killed", len(removed))
    return removed


def _read(path: Path, most: int = MAX_OUTPUT_BYTES) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read(most).decode(errors="replace")
    except FileNotFoundError:
        return ""


def _head(path: Path) -> str:
    """The first bytes of a record's output: enough to tell whether py-spy wrote anything."""
    return _read(path, 4096)


def _lines(path: Path) -> Iterator[str]:
    """py-spy's output, line by line, at most MAX_OUTPUT_BYTES, a line longer than
    MAX_OUTPUT_LINE skipped (never held whole)."""
    try:
        fh = open(path, "rb")  # noqa: SIM115  (closed below; a generator)
    except FileNotFoundError:
        return
    with fh:
        total, skipping = 0, False
        while total < MAX_OUTPUT_BYTES:
            line = fh.readline(MAX_OUTPUT_LINE)
            if not line:
                return
            total += len(line)
            whole = line.endswith(b"\n")
            if not skipping and (whole or len(line) < MAX_OUTPUT_LINE):
                yield line.decode(errors="replace")
            skipping = not whole

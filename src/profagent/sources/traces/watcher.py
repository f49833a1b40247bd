"""Watching trace folders: which files are traces, when they are complete, what was done.

Files are read in turn per owner, only when complete and only if owned by someone trusted;
what was done with each is kept across restarts (the rules are above ``FolderWatcher``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.polling import PollingObserver

from profagent.system.safefs import UnsafePath, open_regular

log = logging.getLogger(__name__)

STATE_LIMIT = 10000  # processed entries kept in the state file
MAX_EXHAUSTED = 4096  # paths remembered as never to be read again (incomplete too long, or refused)
STATE_SAVE_EVERY = 1.0  # seconds: thousands of tiny files must not mean thousands of rewrites
Signature = tuple[int, int]  # (size, mtime_ns)


def is_candidate(path: str) -> bool:
    name = os.path.basename(path)
    if name.startswith(".") or name.endswith(".tmp"):
        return False
    return name.endswith(".json") or name.endswith(".json.gz")


def signature(st: os.stat_result) -> Signature:
    return (st.st_size, st.st_mtime_ns)


class Processed:
    """(path -> size, mtime_ns, status) of files already counted, persisted as JSON."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._entries: dict[str, tuple[int, int, str]] = {}
        self._unsaved = False
        if path is not None:
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
            self._entries = {k: (int(v[0]), int(v[1]), str(v[2])) for k, v in data.get("files", {}).items()}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, AttributeError, IndexError) as exc:
            log.warning("ignoring unreadable trace state file %s (%s)", path, exc)

    def done(self, path: str, sig: Signature) -> bool:
        entry = self._entries.get(path)
        return entry is not None and (entry[0], entry[1]) == sig

    def add(self, path: str, sig: Signature, status: str) -> None:
        self._entries[path] = (sig[0], sig[1], status)
        if len(self._entries) > STATE_LIMIT:
            for old in list(self._entries)[: len(self._entries) - STATE_LIMIT]:
                del self._entries[old]
        self._unsaved = True

    def save(self) -> None:
        """Write the entries if they changed since the last save."""
        if self.path is None or not self._unsaved:
            return
        self._unsaved = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps({"version": 1, "files": self._entries}))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("cannot write trace state file %s (%s): a restart may count traces again", self.path, exc)


@dataclass
class Pending:
    first_seen: float
    sig: Signature | None = None
    stable_since: float = 0.0
    attempted_at: float | None = None
    failed_sig: Signature | None = None
    reason: str = ""
    message: str = ""
    failures: int = 0  # attempts that found it incomplete: each doubles the wait before the next
    cpu: float = 0.0  # CPU seconds its incomplete reads took, all together


@dataclass(frozen=True)
class Verdict:
    """What to do with a file now: ``attempt`` it, or count it with ``status``/``reason``."""

    path: str
    sig: Signature
    action: str  # attempt, skipped, invalid
    reason: str = ""
    message: str = ""
    uid: int = -1  # the file's owner when it was judged (attempts only)


class _Handler(FileSystemEventHandler):
    def __init__(self, notify: Callable[[str], None]) -> None:
        self._notify = notify

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.is_directory:
            return
        for path in (event.src_path, getattr(event, "dest_path", "")):
            if path:
                self._notify(os.fsdecode(path))


# - Candidates: ``*.json`` and ``*.json.gz`` (``*.pt.trace.json[.gz]`` from
#   ``tensorboard_trace_handler``, on-demand ``*.json``), recursively (the on-demand folder:
#   its own files only, no watch per subfolder); ``*.tmp`` and hidden
#   files are ignored (Kineto writes ``.json`` to a ``.tmp`` file and renames it).
# - Completeness: a ``.json.gz`` is streamed into its final path, so it is read only once
#   its size and mtime have been stable for ``settle_seconds``; reading then checks that the
#   gzip stream and the JSON are complete. A ``.json`` must end with ``}``.
# - A file that is still incomplete is retried whenever it changes, and counted ``invalid``
#   (with its reason) once it has been incomplete for ``invalid_after`` seconds, or once its
#   reads have taken ``incomplete_cpu`` seconds of CPU (reason ``cpu_budget``); its path is
#   then not read again, however its writer goes on changing it; nor is a file that was
#   read and refused (a cap on what is inside it).
# - Files are read users in turn (by each file's owner), one of each user's at a time, and a
#   round lasts at most ``source.WORK_SLICE``: a newcomer's file is read within about that.
# - Files are only ever opened for reading, without following a symlink and without waiting
#   on a FIFO; only regular files owned by root, the agent, a watched folder's owner or a
#   job's user are read (others are ``skipped`` with reason ``symlink``, ``not_regular`` or
#   ``foreign_owner``); whose job a trace is, once read, is ``source.attribute``'s call.
#   A file that keeps changing is attempted at most once per settle period.
# - What was done with each (path, size, mtime) is kept in a small JSON state file, written
#   at most once a second, so a restart does not count a file twice.
class FolderWatcher:
    """Collects candidate paths from watchdog (inotify or polling) and decides when each
    is ready. Thread-safe: watchdog threads call ``notify``; one worker calls ``due``."""

    def __init__(
        self,
        dirs: list[Path],
        processed: Processed,
        settle_seconds: float,
        invalid_after: float,
        max_file_bytes: int,
        polling: bool = False,
        flat: Iterable[Path] = (),
        incomplete_cpu: float = 5.0,
    ) -> None:
        """``flat``: folders watched and scanned without their subfolders (the on-demand
        folder: libkineto writes there directly, and anyone may make folders in it: 30,000
        empty ones were 30,001 root inotify watches and a busy thread)."""
        self.dirs = dirs
        self.flat = frozenset(flat)
        self.processed = processed
        self.settle = settle_seconds
        self.invalid_after = invalid_after
        self.max_bytes = max_file_bytes
        self.incomplete_cpu = incomplete_cpu  # traces.incomplete_cpu_seconds
        self.polling = polling
        self.wake = threading.Event()
        self._lock = threading.Lock()
        self._dirty: set[str] = set()
        self._pending: dict[str, Pending] = {}
        self._observer: Observer | PollingObserver | None = None  # type: ignore[valid-type]
        self._handler = _Handler(self.notify)
        self._missing: list[Path] = []
        self._missing_checked = 0.0
        self._saved_at = 0.0
        self._job_pids: frozenset[int] = frozenset()
        # paths counted invalid for staying incomplete (deadline or CPU budget): a writer that
        # goes on appending would otherwise start a fresh deadline and budget at each change
        self._exhausted: dict[str, None] = {}
        self._before: dict[str, float | None] = {}  # attempted_at of this round's attempts before it
        self._job_uids: frozenset[int] = frozenset()
        self._owners = {0, os.geteuid()}
        for d in dirs:
            with contextlib.suppress(OSError):
                self._owners.add(d.stat().st_uid)

    def set_job_pids(self, pids: Iterable[int]) -> None:
        """The target's processes: files their users own may be read as traces."""
        pids = frozenset(pids)
        if pids == self._job_pids:
            return
        uids = set()
        for pid in pids:
            with contextlib.suppress(OSError):
                uids.add(os.stat(f"/proc/{pid}").st_uid)
        self._job_pids, self._job_uids = pids, frozenset(uids)

    def owner_ok(self, uid: int) -> bool:
        """Whether a file owned by ``uid`` could have been written by the job (or root, the
        agent, a watched folder's owner); anyone else's file is not a trace of ours."""
        return uid in self._owners or uid in self._job_uids

    def start(self) -> None:
        """Watch every existing folder (falls back to polling if inotify fails) and scan
        what they hold; folders that do not exist yet are picked up when they appear."""
        self._handler = _Handler(self.notify)
        present = [d for d in self.dirs if d.is_dir()]
        self._missing = [d for d in self.dirs if not d.is_dir()]
        for d in self._missing:
            log.warning("trace folder %s does not exist yet: it will be watched once created", d)
        try:
            self._observer = self._schedule(PollingObserver(timeout=0.5) if self.polling else Observer(), present)
        except OSError as exc:  # inotify watch limit, unsupported filesystem...
            log.warning("inotify unavailable (%s): polling the trace folders instead", exc)
            self._observer = self._schedule(PollingObserver(timeout=0.5), present)
        for d in present:
            self._scan(d)

    def _schedule(self, observer, dirs):  # type: ignore[no-untyped-def]
        for d in dirs:
            observer.schedule(self._handler, str(d), recursive=d not in self.flat)
        observer.daemon = True
        observer.start()
        return observer

    def _scan(self, folder: Path) -> None:
        if folder in self.flat:
            with contextlib.suppress(OSError), os.scandir(folder) as entries:
                for entry in entries:
                    self.notify(os.path.join(folder, entry.name))
            return
        for root, _, files in os.walk(folder):
            for name in files:
                self.notify(os.path.join(root, name))

    def _appeared(self, now: float) -> None:
        if not self._missing or now - self._missing_checked < 1.0:
            return
        self._missing_checked = now
        for d in list(self._missing):
            if d.is_dir() and self._observer is not None:
                try:
                    self._observer.schedule(self._handler, str(d), recursive=d not in self.flat)
                except OSError as exc:
                    log.warning("cannot watch %s (%s)", d, exc)
                    continue
                self._missing.remove(d)
                self._scan(d)

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(1.0)
        self.processed.save()
        self.wake.set()

    def notify(self, path: str) -> None:
        if is_candidate(path):
            with self._lock:
                self._dirty.add(path)
            self.wake.set()

    @property
    def waiting(self) -> int:
        return len(self._pending)

    def due(self, now: float) -> list[Verdict]:
        """Files to attempt or to count now. Call ``failed`` after a failed attempt."""
        self._appeared(now)
        if now - self._saved_at >= STATE_SAVE_EVERY:
            self._saved_at = now
            self.processed.save()
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        for path in dirty:
            if path not in self._exhausted:
                self._pending.setdefault(path, Pending(first_seen=now))
        out: list[Verdict] = []
        attempts: dict[int, list[Verdict]] = {}  # uid -> its files to read now
        self._before = {}
        for path, p in list(self._pending.items()):
            before = p.attempted_at
            verdict = self._check(path, p, now)
            if verdict is None:
                continue
            if verdict.action == "attempt":
                attempts.setdefault(verdict.uid, []).append(verdict)
                self._before[path] = before
            else:
                out.append(verdict)
        # Users in turn (by each file's owner): one file of each, then the next of each...,
        # so a user with hundreds of files delays another user's trace by one read, not by
        # all of theirs. The reader takes a slice of this list and defers the rest (defer()),
        # and the next round puts a newcomer's file first again.
        queues = list(attempts.values())
        for i in range(max((len(q) for q in queues), default=0)):
            out.extend(q[i] for q in queues if i < len(q))
        return out

    def defer(self, verdict: Verdict) -> None:
        """An attempt ``due`` returned that the reader leaves for a later round."""
        p = self._pending.get(verdict.path)
        if p is not None and verdict.path in self._before:
            p.attempted_at = self._before[verdict.path]
        self.wake.set()

    def _check(self, path: str, p: Pending, now: float) -> Verdict | None:
        try:
            st = os.lstat(path)  # a symlink is judged as itself, never followed
        except OSError:
            del self._pending[path]  # gone (renamed or deleted by its writer)
            return None
        sig = signature(st)
        if self.processed.done(path, sig):
            del self._pending[path]
            return None
        if sig != p.sig:
            p.sig, p.stable_since = sig, now
        if stat.S_ISLNK(st.st_mode):
            return self._final(path, sig, "skipped", "symlink", "a symbolic link: not followed")
        if not stat.S_ISREG(st.st_mode):
            return self._final(path, sig, "skipped", "not_regular", "not a regular file (a FIFO, socket or device?)")
        if not self.owner_ok(st.st_uid):
            return self._final(path, sig, "skipped", "foreign_owner",
                               f"owned by uid {st.st_uid}, which neither the job nor the folder's owner is")
        if st.st_size > self.max_bytes:
            return self._final(path, sig, "skipped", "too_large",
                               f"{st.st_size} bytes is over traces.max_file_bytes ({self.max_bytes})")
        if p.failures and p.cpu >= self.incomplete_cpu:
            # a file kept incomplete on purpose (appended to every 0.7 s) costs at most this
            self._exhaust(path)
            return self._final(path, sig, "invalid", "cpu_budget",
                               f"still incomplete after {p.cpu:.1f} s of CPU over {p.failures} reads "
                               f"(traces.incomplete_cpu_seconds = {self.incomplete_cpu:g})")
        if p.failures and now - p.first_seen >= self.invalid_after:
            self._exhaust(path)
            return self._final(path, sig, "invalid", p.reason or "truncated",
                               p.message or f"still incomplete after {self.invalid_after:g}s")
        if p.attempted_at is not None and now - p.attempted_at < self.settle * 2 ** min(p.failures, 16):
            # a file that keeps growing is read at most once per settle period, and each time
            # it was found incomplete the wait doubles: a .json.gz appended to every 0.7 s
            # (re-inflated whole at each attempt) kept the agent at 60% of a core; now it costs
            # about log2(invalid_after / settle_seconds) reads before it counts as invalid
            return None
        if p.failed_sig == sig or not self._complete_enough(path, p, now):
            if now - p.first_seen >= self.invalid_after:
                self._exhaust(path)
                return self._final(path, sig, "invalid", p.reason or "truncated",
                                   p.message or f"still incomplete after {self.invalid_after:g}s")
            return None
        p.attempted_at = now
        return Verdict(path, sig, "attempt", uid=st.st_uid)

    def _exhaust(self, path: str) -> None:
        """Never look at ``path`` again (until MAX_EXHAUSTED newer ones push it out)."""
        self._exhausted[path] = None
        while len(self._exhausted) > MAX_EXHAUSTED:
            del self._exhausted[next(iter(self._exhausted))]

    def _complete_enough(self, path: str, p: Pending, now: float) -> bool:
        if path.endswith(".gz"):
            return now - p.stable_since >= self.settle
        try:
            with os.fdopen(open_regular(path, self.owner_ok, exact=True), "rb") as fh:
                fh.seek(max(0, (p.sig or (0, 0))[0] - 64))
                tail = fh.read(4096).rstrip()
        except (OSError, UnsafePath):
            return False
        return tail.endswith(b"}") or now - p.stable_since >= self.settle

    def _final(self, path: str, sig: Signature, status: str, reason: str, message: str) -> Verdict:
        del self._pending[path]
        return Verdict(path, sig, status, reason, message)

    def failed(self, verdict: Verdict, reason: str, message: str, cpu: float = 0.0) -> None:
        """An attempt found the file incomplete (after ``cpu`` seconds of reading): wait for
        it to change, until its deadline (invalid_after) or its CPU budget runs out."""
        p = self._pending.get(verdict.path)
        if p is not None:
            p.failed_sig, p.reason, p.message = verdict.sig, reason, message
            p.failures += 1
            p.cpu += cpu

    def finished(self, verdict: Verdict, status: str) -> None:
        """The file is counted: remember it and stop watching it. One read and refused
        (a cap on what is inside, a forged field) is not read again when it changes: a
        writer appending to it would otherwise cost a whole read at each change."""
        self._pending.pop(verdict.path, None)
        self.processed.add(verdict.path, verdict.sig, status)
        if status != "ingested":
            self._exhaust(verdict.path)


def default_state_dir(configured: str, environ: dict[str, str] | None = None) -> Path:
    """agent.state_dir, else $XDG_STATE_HOME/profagent (~/.local/state), /var/lib as root."""
    if configured:
        return Path(configured)
    env = os.environ if environ is None else environ
    if os.geteuid() == 0:
        return Path("/var/lib/profagent")
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "profagent"


def resolve_dirs(dirs: list[str]) -> list[Path]:
    out = []
    for d in dirs:
        with contextlib.suppress(OSError):
            out.append(Path(d).expanduser().resolve())
    return out

"""The Kineto daemon endpoint: the datagram socket libkineto polls, the registry of polling
processes, and the trace requests handed to them on their next poll.

Any local user can write to the socket, so polls are authenticated by kernel credentials,
and the registry and the datagrams are bounded per user (the comment above ``POLLER_TTL``).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import select
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from profagent.errors import NotApplicable, SourceUnavailable, SourceWaiting, UserError
from profagent.sources.ondemand import kineto
from profagent.system.cputime import CPU
from profagent.system.safefs import UnsafePath, own_directory
from profagent.system.unixsock import (
    Holder,
    abstract_address,
    abstract_holders,
    close_unix_socket,
    describe_address,
    is_stale,
)

log = logging.getLogger(__name__)

# Any local user can write to the socket, so each poll is authenticated by the sender's
# kernel credentials (SCM_CREDENTIALS): the poll's PID must be the sender's, and of the
# ancestors it lists only those that really are its ancestors are kept (a process cannot
# pose as another job's child to receive that job's trace config). Replies never wait on a
# sender that does not read them.
#
# The registry is bounded per user (by the sender's uid) and in all. A new process of a
# user at ``max_per_user`` replaces that user's least recently seen entry; a new process
# when the registry is full replaces the least recently seen entry of the user holding the
# most (its own, on a tie). So a user who floods it with short-lived pollers only ever evicts its own entries,
# and another user's new job always gets in. Each eviction is counted (``evicted``).
#
# Datagrams are rate-limited before they are read, by the sender's kernel credentials: a
# process may send POLLS_PER_PROCESS a second (bursts of POLL_BURST; libkineto polls about
# once a second), a user USER_POLLS_PER_SECOND (bursts of USER_POLL_BURST). What is over is
# dropped unread and unanswered, counted as ``rate_limited``; the process polls again. 100
# processes polling flat out (44k polls) once cost ~23% of a core and made another user's
# `profagent trace` fail. Replies go out through one socket per user (ReplySockets), so
# unread replies to one user's processes never fill the send buffer another user's need.
POLLER_TTL = 60.0  # libkineto polls every ~5 s; silent this long means gone
MALFORMED_LOG_EVERY = 100
MAX_POLLERS = 4096  # far more processes than a node traces; a flood cannot grow the registry past it
MAX_POLLERS_PER_USER = 256  # ondemand.max_pollers_per_user: far more ranks than one user runs on a node
POLLS_PER_PROCESS, POLL_BURST = 2.0, 5  # datagrams a second per sending process, and its burst
USER_POLLS_PER_SECOND, USER_POLL_BURST = 50.0, 100  # per user (uid): 50 processes at libkineto's pace
DRAIN_BATCH = 256  # datagrams read per wake-up, before the stop flag is looked at again
MAX_BUCKETS = 8192  # senders remembered by the rate limit (the least recently seen go first)
MAX_ANCESTORS = 32  # pids kept per poll (the process and its ancestors)
MAX_REPLY_SOCKETS = 256  # users with a reply socket of their own (ReplySockets)
# libkineto drops a config without a word in two cases, and the process then polls free
# to trace with no trace file; the config is sent again:
# - a timed config it receives too late to warm up (it starts within 2 s of receiving it,
#   "insufficient time for warmup": a process paused then, by a debugger or a blocking
#   py-spy dump, misses that window). Sent again at most MAX_RESENDS times, and only while
#   the trace, had it started, would still run (it starts TIMED_START after the send):
#   after that a free poll may come while the file is being written.
# - an iteration config it receives before the process's first step (libkineto counts
#   iterations from optimizer steps). With a duration in it, libkineto would instead run a
#   timed trace of that duration (500 ms by default: on a loaded node, 13 steps for
#   --iterations 2, or none at all before the first step); kineto.config_text sets it to 0.
#   Sent again every RESEND_AFTER until the request's deadline: a second copy is refused
#   while one waits for its iteration, and a running trace polls busy.
RESEND_AFTER = 3.0
RETRY_BIND_SECONDS = 5.0  # a held endpoint is tried again this often (taken once its holder lets go)
TIMED_START = 7.0  # warm-up (5 s) and libkineto's start delay (2 s)
MAX_RESENDS = 3
_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
SQUAT_FIX = ("stop that process (profagent takes the endpoint once it is free); or set ondemand.socket_dir = \"/run/profagent\" and "
             "KINETO_IPC_SOCKET_DIR=/run/profagent in the jobs (a root folder no user can take first); "
             "or ondemand.enabled = false")


@dataclass(frozen=True)
class Sender:
    """Who sent a datagram, as the kernel says (pid 0: unknown, e.g. another pid namespace)."""

    pid: int
    uid: int


@dataclass(frozen=True)
class Poller:
    pid: int
    pids: tuple[int, ...]  # itself, then ancestors
    jobid: int
    can_trace: bool
    last_seen: float
    uid: int = -1  # the sender's, from SCM_CREDENTIALS (-1: not known)


@dataclass
class TraceTarget:
    pid: int
    file: str
    sent_at: float | None = None
    resent: int = 0  # times sent again after libkineto dropped it

    def dropped(self, now: float, options: kineto.TraceOptions) -> bool:
        """Sent, and the process polls free to trace with no file: libkineto dropped it
        (see RESEND_AFTER's comment for when to send it again)."""
        if self.sent_at is None or os.path.lexists(self.file):
            return False
        age = now - self.sent_at
        if options.iterations:
            return age >= RESEND_AFTER
        return self.resent < MAX_RESENDS and RESEND_AFTER <= age < TIMED_START + options.duration_ms / 1000


@dataclass
class TraceRequest:
    id: str
    options: kineto.TraceOptions
    log_file: str
    created: float
    deadline: float
    targets: dict[int, TraceTarget] = field(default_factory=dict)
    periodic: bool = False


class EndpointHeld(SourceWaiting):
    """A root agent found the abstract endpoint bound by a process that is not root's
    (or, retrying, by anyone): ``problem`` and ``fix`` make its one line."""

    def __init__(self, problem: str, fix: str = SQUAT_FIX) -> None:
        super().__init__(f"{problem}: {fix}", "endpoint_held")
        self.problem, self.fix = problem, fix


class NoPollers(UserError):
    """No registered process matches the request."""


class Endpoint:
    """The Kineto daemon socket, the registry of polling processes and pending requests."""

    def __init__(self, socket_dir: str = "", clock: Callable[[], float] = time.monotonic,
                 max_pollers: int = MAX_POLLERS, max_per_user: int = MAX_POLLERS_PER_USER,
                 poll_rate: tuple[float, int] = (POLLS_PER_PROCESS, POLL_BURST),
                 user_poll_rate: tuple[float, int] = (USER_POLLS_PER_SECOND, USER_POLL_BURST)) -> None:
        """``poll_rate``, ``user_poll_rate``: (datagrams a second, burst) per sending process
        and per user."""
        self.socket_dir = socket_dir
        self._clock = clock
        self.max_pollers, self.max_per_user = max_pollers, min(max_per_user, max_pollers)
        self._lock = threading.Lock()
        self._pollers: dict[int, Poller] = {}
        self._by_user: dict[int, dict[int, None]] = {}  # uid -> its pids, least recently seen first
        self._requests: dict[str, TraceRequest] = {}
        self._counts: dict[str, int] = {}
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._limited = 0  # datagrams over the rate, not yet counted
        self._per_process = TokenBuckets(*poll_rate)
        self._per_user = TokenBuckets(*user_poll_rate)
        self._replies = ReplySockets(socket_dir)

    @property
    def address(self) -> str | bytes:
        if self.socket_dir:
            return os.path.join(self.socket_dir, kineto.DAEMON_NAME)
        return abstract_address(kineto.DAEMON_NAME + "\0")  # the trailing NUL is part of the name

    def describe(self) -> str:
        return describe_address(self.address)

    def bind(self) -> None:
        """Raises NotApplicable when another root daemon (dynolog) holds the name, EndpointHeld
        when a root agent finds it held by anyone else (retried: see OndemandSource),
        SourceUnavailable when it cannot bind for another reason."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # each datagram carries its sender
        address = self.address
        if isinstance(address, str):
            try:
                # Ours, or refused: whoever owns the folder could swap the socket under the jobs.
                own_directory(self.socket_dir, 0o755)
            except UnsafePath as exc:
                sock.close()
                raise SourceUnavailable(f"refusing the Kineto socket folder: {exc}; remove it or set ondemand.socket_dir") from None
            except OSError as exc:
                sock.close()
                raise SourceUnavailable(f"cannot create the Kineto socket folder {self.socket_dir!r} ({exc.strerror}): on-demand tracing off") from None
            if os.path.lexists(address) and is_stale(address, socket.SOCK_DGRAM):
                os.unlink(address)
        try:
            sock.bind(address)
            if isinstance(address, str):
                # Jobs of any user must reach it (the unit's UMask=0077 would make it 0700);
                # who sent each poll is checked by its credentials, not by this mode.
                os.chmod(address, 0o666)
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE and isinstance(address, bytes) and os.geteuid() == 0:
                holders = abstract_holders(address)
                if not holders or not any(h.uid == 0 for h in holders):
                    raise EndpointHeld(_squatted(self.describe(), holders)) from None
            if exc.errno == errno.EADDRINUSE:
                raise NotApplicable(
                    f"the Kineto daemon endpoint {self.describe()} is held by another daemon (dynolog?): "
                    "on-demand tracing off; stop it or use `profagent trace` through that daemon",
                    "held_by_another_agent",
                ) from None
            raise SourceUnavailable(f"cannot bind the Kineto endpoint {self.describe()} ({exc.strerror}): on-demand tracing off") from None
        sock.setblocking(False)  # replies never wait on a peer that does not read them
        self._sock = sock

    def close(self) -> None:
        close_unix_socket(self._sock, self.address if isinstance(self.address, str) else None)
        self._sock = None
        self._replies.close()

    def serve(self, stop: threading.Event) -> None:
        """Answer datagrams until ``stop`` is set (run in a thread)."""
        while not stop.is_set() and self._sock is not None:
            try:
                readable, _, _ = select.select([self._sock], [], [], 0.2)
            except (OSError, ValueError):
                if stop.is_set() or self._sock is None:
                    return
                continue
            if readable:
                self._drain(DRAIN_BATCH)

    def _drain(self, most: int) -> None:
        """Read up to ``most`` queued datagrams without waiting: a flood is read as fast as it
        comes, so the queue (where a full one makes every sender wait, another user's job
        too) stays short, and what is over the rate costs a recvmsg and two lookups."""
        sock = self._sock
        space = socket.CMSG_SPACE(_UCRED.size)
        for _ in range(most):
            if sock is None:
                return
            try:
                data, ancdata, _, addr = sock.recvmsg(65536, space, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except (OSError, ValueError):
                return
            sender, now = _sender(ancdata), self._clock()
            if not (self._per_process.take(sender.pid, now) and self._per_user.take(sender.uid, now)):
                self._limited += 1  # unread, unanswered (counted under the lock once per batch)
                continue
            with CPU.charge("ondemand"):
                reply = self.handle(data, sender)
            if reply is not None and addr:
                try:
                    (self._replies.sender(sender.uid) or sock).sendto(reply, socket.MSG_DONTWAIT, addr)
                except BlockingIOError:
                    self._count("reply_dropped")  # the sender does not read its replies
                except OSError:
                    self._count("reply_failed")
        if self._limited:
            with self._lock:
                self._counts["rate_limited"] = self._counts.get("rate_limited", 0) + self._limited
            self._limited = 0

    def _count(self, kind: str) -> None:
        with self._lock:
            self._counts[kind] = self._counts.get(kind, 0) + 1

    def handle(self, datagram: bytes, sender: Sender | None = None) -> bytes | None:
        """One datagram in, the reply out (None = no reply). Never raises.

        ``sender``: the kernel's credentials of the datagram (``serve`` always passes them;
        None only for callers that already know who sent it).
        """
        try:
            message = kineto.decode(datagram)
        except kineto.MalformedDatagram as exc:
            self._count("malformed")
            with self._lock:
                n = self._counts["malformed"]
            if n % MALFORMED_LOG_EVERY == 1:
                log.warning("dropped a malformed Kineto datagram (%s); %d so far", exc, n)
            return None
        if isinstance(message, kineto.Context):
            self._count("ctxt")
            return kineto.reply_context(1)
        pids = message.pids[:MAX_ANCESTORS]
        if sender is not None:
            if sender.pid <= 0 or sender.pid != message.pid:
                self._refused("spoofed", f"a poll claiming PID {message.pid} came from PID {sender.pid} (uid {sender.uid})")
                return None
            pids = _true_ancestry(pids)
        self._count("poll")
        now = self._clock()
        uid = sender.uid if sender is not None else -1
        with self._lock:
            evicted = self._make_room(uid, now) if message.pid not in self._pollers else None
            self._forget(message.pid)
            self._pollers[message.pid] = Poller(message.pid, pids, message.jobid, message.can_trace, now, uid)
            self._by_user.setdefault(uid, {})[message.pid] = None  # now the most recently seen
        if evicted is not None:
            self._refused("evicted", f"registry full for uid {evicted.uid} (ondemand.max_pollers_per_user = "
                          f"{self.max_per_user}, ondemand.max_pollers = {self.max_pollers}): PID {evicted.pid}, "
                          f"seen {now - evicted.last_seen:.0f} s ago, replaced by PID {message.pid}")
        with self._lock:
            if not message.can_trace:
                return kineto.reply_config("")  # a trace is already running there
            for request in self._requests.values():
                target = request.targets.get(message.pid)
                if target is None or now >= request.deadline:
                    continue
                if target.sent_at is None or target.dropped(now, request.options):
                    kind = "sent"
                    if target.sent_at is not None:
                        kind = "resent"
                        target.resent += 1
                    target.sent_at = now
                    self._counts[kind] = self._counts.get(kind, 0) + 1
                    return kineto.reply_config(kineto.config_text(request.log_file, request.options, request.id))
        return kineto.reply_config("")

    def _forget(self, pid: int) -> Poller | None:
        """Drop one entry (lock held)."""
        gone = self._pollers.pop(pid, None)
        if gone is not None:
            mine = self._by_user.get(gone.uid, {})
            mine.pop(pid, None)
            if not mine:
                self._by_user.pop(gone.uid, None)
        return gone

    def _make_room(self, uid: int, now: float) -> Poller | None:
        """Room for a new entry of ``uid`` (lock held): the evicted entry, if one was."""
        if len(self._by_user.get(uid, ())) >= self.max_per_user:
            return self._forget(next(iter(self._by_user[uid])))
        if len(self._pollers) < self.max_pollers:
            return None
        for pid in [p for p, v in self._pollers.items() if now - v.last_seen >= POLLER_TTL]:
            self._forget(pid)
        if len(self._pollers) < self.max_pollers:
            return None
        most = max(len(pids) for pids in self._by_user.values())
        mine = self._by_user.get(uid, {})
        victim = mine if len(mine) == most else next(p for p in self._by_user.values() if len(p) == most)
        return self._forget(next(iter(victim)))

    def _refused(self, kind: str, message: str) -> None:
        self._count(kind)
        with self._lock:
            n = self._counts[kind]
        if n % MALFORMED_LOG_EVERY == 1:
            log.warning("refused a Kineto poll: %s; %d refused so far", message, n)

    def pollers(self) -> list[Poller]:
        now = self._clock()
        with self._lock:
            for pid in [p for p, v in self._pollers.items() if now - v.last_seen >= POLLER_TTL]:
                self._forget(pid)
            return sorted(self._pollers.values(), key=lambda p: p.pid)

    def request(
        self,
        match: Callable[[Poller], bool],
        options: kineto.TraceOptions,
        trace_dir: str,
        timeout: float,
        periodic: bool = False,
    ) -> TraceRequest:
        """Queue a trace for every registered process ``match`` accepts. Raises NoPollers."""
        chosen = [p for p in self.pollers() if match(p)]
        if not chosen:
            raise NoPollers("no registered process matches")
        rid = f"{time.strftime('%Y%m%d-%H%M%S')}-{next(self._ids)}-{uuid.uuid4().hex[:6]}"
        log_file = os.path.join(trace_dir, f"profagent_{rid}.json")
        now = self._clock()
        request = TraceRequest(rid, options, log_file, now, now + timeout, periodic=periodic)
        for p in chosen:
            request.targets[p.pid] = TraceTarget(p.pid, kineto.output_path(log_file, p.pid))
        with self._lock:
            self._requests[rid] = request
            self._counts["requested"] = self._counts.get("requested", 0) + 1
        return request

    def get(self, rid: str) -> TraceRequest | None:
        with self._lock:
            return self._requests.get(rid)

    def expire(self, keep_seconds: float = 600.0) -> list[TraceRequest]:
        """Forget requests long past their deadline; returns them."""
        now = self._clock()
        with self._lock:
            old = [r for r in self._requests.values() if now > r.deadline + keep_seconds]
            for r in old:
                del self._requests[r.id]
                if any(t.sent_at is None for t in r.targets.values()):
                    self._counts["expired"] = self._counts.get("expired", 0) + 1
            return old

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class ReplySockets:
    """One sending socket per uid for the replies. A reply waits in its receiver's queue,
    charged to the socket that sent it, until read: 60 processes of nobody that poll and
    never read once held the endpoint's whole send buffer, and every reply to alice's job
    was dropped (3 of 10 polls answered). Each user's unread replies now fill that user's
    own socket only. libkineto ends its process on a reply from a name it does not expect:
    with KINETO_IPC_SOCKET_DIR it must be a path in that folder (``dynolog.r<uid>`` in the
    agent's own), else an abstract name (the kernel's choice). At most MAX_REPLY_SOCKETS,
    the least recently used closed first (its replies stay queued where they were)."""

    def __init__(self, socket_dir: str, most: int = MAX_REPLY_SOCKETS) -> None:
        self.socket_dir, self.most = socket_dir, most
        self._by_uid: dict[int, tuple[socket.socket, str | None]] = {}  # least recently used first

    def sender(self, uid: int) -> socket.socket | None:
        """The reply socket of ``uid``; None if none can be made (the caller uses its own)."""
        found = self._by_uid.pop(uid, None)
        if found is None:
            found = self._open(uid)
            if found is None:
                return None
        self._by_uid[uid] = found
        while len(self._by_uid) > self.most:
            _close(*self._by_uid.pop(next(iter(self._by_uid))))
        return found[0]

    def _open(self, uid: int) -> tuple[socket.socket, str | None] | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        path = os.path.join(self.socket_dir, f"dynolog.r{uid if uid >= 0 else 'x'}") if self.socket_dir else None
        try:
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # a stale one of ours: the folder is the agent's own (Endpoint.bind)
            sock.bind(path if path is not None else "")  # "": an abstract name of the kernel's choosing
        except OSError as exc:
            sock.close()
            log.debug("no reply socket for uid %d: %s", uid, exc)
            return None
        return sock, path

    def close(self) -> None:
        for sock, path in self._by_uid.values():
            _close(sock, path)
        self._by_uid.clear()


def _close(sock: socket.socket, path: str | None) -> None:
    sock.close()
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)


class TokenBuckets:
    """One token bucket per key (a PID, a uid): ``rate`` a second, at most ``burst`` saved.
    Keys are bounded by MAX_BUCKETS: past it the least recently used is forgotten (a flood
    of short-lived senders only forgets its own, which start full again)."""

    def __init__(self, rate: float, burst: int, max_keys: int = MAX_BUCKETS) -> None:
        self.rate, self.burst, self.max_keys = rate, float(burst), max_keys
        self._buckets: dict[int, tuple[float, float]] = {}  # key -> (tokens, when), least recently used first

    def take(self, key: int, now: float) -> bool:
        """Take one token of ``key``'s bucket; False when it is empty."""
        tokens, when = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - when) * self.rate)
        ok = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if ok else tokens, now)
        if len(self._buckets) > self.max_keys:
            del self._buckets[next(iter(self._buckets))]
        return ok



def _squatted(endpoint: str, holders: list[Holder] | None) -> str:
    """Why a root agent refuses an abstract endpoint held by someone else: the holder
    answers every job's poll, so it decides where their traces go (into its own folder)."""
    if holders:
        who = ", ".join(f"PID {h.pid} of uid {h.uid}" for h in holders[:3])
    else:
        who = "a process profagent cannot name (another PID namespace?)"
    return (f"the Kineto endpoint {endpoint} is held by {who}, not by root: whoever holds it tells every job "
            f"that polls it where to write its on-demand traces, so on-demand tracing is off until it is free "
            f"(profagent tries it again every {RETRY_BIND_SECONDS:g} s)")


def _sender(ancdata: list[tuple[int, int, bytes]]) -> Sender:
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            pid, uid, _ = _UCRED.unpack_from(data)
            return Sender(pid, uid)
    return Sender(0, -1)


def _true_ancestry(pids: tuple[int, ...]) -> tuple[int, ...]:
    """The listed pids up to the first one that is not the real parent of the one before:
    a poll lists the process then its ancestors, and only the kernel's word counts."""
    kept = [pids[0]]
    for pid in pids[1:]:
        try:
            parent = psutil.Process(kept[-1]).ppid()
        except psutil.Error:
            break
        if parent != pid:
            break
        kept.append(pid)
    return tuple(kept)


def match_pid(pid: int) -> Callable[[Poller], bool]:
    """A process matches a PID when it is that process or a descendant of it."""
    return lambda p: pid in p.pids

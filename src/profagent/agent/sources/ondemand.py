"""The `ondemand` source: host Kineto's daemon endpoint so traces need no code change.

Processes started with ``KINETO_USE_DAEMON=1`` poll the endpoint every ~5 s; each poll
registers them (a process silent for 60 s is gone). ``profagent trace`` asks, over the
control socket (``agent/control.py``), for a trace of matching processes; the next poll
of each gets the config, and libkineto writes ``<trace_dir>/profagent_<id>_<pid>.json``,
which the traces source ingests like any other trace.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from profagent.agent import kineto
from profagent.agent.sources import SourceUnavailable
from profagent.agent.target import ProcessTree

log = logging.getLogger(__name__)

POLLER_TTL = 60.0  # libkineto polls every ~5 s; silent this long means gone
MALFORMED_LOG_EVERY = 100


@dataclass(frozen=True)
class Poller:
    pid: int
    pids: tuple[int, ...]  # itself, then ancestors
    jobid: int
    can_trace: bool
    last_seen: float


@dataclass
class Target:
    pid: int
    file: str
    sent_at: float | None = None


@dataclass
class TraceRequest:
    id: str
    options: kineto.TraceOptions
    log_file: str
    created: float
    deadline: float
    targets: dict[int, Target] = field(default_factory=dict)
    periodic: bool = False


@dataclass(frozen=True)
class OndemandSnapshot:
    processes: tuple[tuple[str, str, str, int], ...]  # (job_id, rank, role, count) of pollers in the tree
    unmatched: int  # pollers outside the target tree
    datagrams: tuple[tuple[str, int], ...]  # kind -> count (poll, ctxt, malformed)
    requests: tuple[tuple[str, int], ...]  # status -> count (requested, sent, written, expired)


class NoPollers(Exception):
    """No registered process matches; the message tells the user how to make one poll."""


class Endpoint:
    """The Kineto daemon socket, the registry of polling processes and pending requests."""

    def __init__(self, socket_dir: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        self.socket_dir = socket_dir
        self._clock = clock
        self._lock = threading.Lock()
        self._pollers: dict[int, Poller] = {}
        self._requests: dict[str, TraceRequest] = {}
        self._counts: dict[str, int] = {}
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)

    @property
    def address(self) -> str | bytes:
        if self.socket_dir:
            return os.path.join(self.socket_dir, kineto.DAEMON_NAME)
        return b"\0" + kineto.DAEMON_NAME.encode() + b"\0"  # the trailing NUL is part of the name

    def describe(self) -> str:
        return self.address if isinstance(self.address, str) else "@" + kineto.DAEMON_NAME

    def bind(self) -> None:
        """Raises SourceUnavailable when another daemon holds the name."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        address = self.address
        if isinstance(address, str):
            os.makedirs(self.socket_dir, exist_ok=True)
            if os.path.exists(address) and _stale_dgram(address):
                os.unlink(address)
        try:
            sock.bind(address)
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise SourceUnavailable(
                    f"the Kineto daemon endpoint {self.describe()} is held by another daemon (dynolog?): "
                    "on-demand tracing off; stop it or use `profagent trace` through that daemon"
                ) from None
            raise SourceUnavailable(f"cannot bind the Kineto endpoint {self.describe()} ({exc.strerror}): on-demand tracing off") from None
        sock.settimeout(0.2)
        self._sock = sock

    def close(self) -> None:
        from profagent.agent.control import close_unix_socket

        close_unix_socket(self._sock, self.address if isinstance(self.address, str) else None)
        self._sock = None

    def serve(self, stop: threading.Event) -> None:
        """Answer datagrams until ``stop`` is set (run in a thread)."""
        while not stop.is_set() and self._sock is not None:
            try:
                data, addr = self._sock.recvfrom(65536)
            except TimeoutError:
                continue
            except OSError:
                if stop.is_set():
                    return
                continue
            reply = self.handle(data)
            if reply is not None and addr:
                try:
                    self._sock.sendto(reply, addr)
                except OSError:
                    self._count("reply_failed")

    def _count(self, kind: str) -> None:
        with self._lock:
            self._counts[kind] = self._counts.get(kind, 0) + 1

    def handle(self, datagram: bytes) -> bytes | None:
        """One datagram in, the reply out (None = no reply). Never raises."""
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
        self._count("poll")
        now = self._clock()
        with self._lock:
            self._pollers[message.pid] = Poller(message.pid, message.pids, message.jobid, message.can_trace, now)
            if not message.can_trace:
                return kineto.reply_config("")  # a trace is already running there
            for request in self._requests.values():
                target = request.targets.get(message.pid)
                if target is not None and target.sent_at is None and now < request.deadline:
                    target.sent_at = now
                    self._counts["sent"] = self._counts.get("sent", 0) + 1
                    return kineto.reply_config(kineto.config_text(request.log_file, request.options, request.id))
        return kineto.reply_config("")

    def pollers(self) -> list[Poller]:
        now = self._clock()
        with self._lock:
            self._pollers = {p: v for p, v in self._pollers.items() if now - v.last_seen < POLLER_TTL}
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
            request.targets[p.pid] = Target(p.pid, kineto.output_path(log_file, p.pid))
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


def _stale_dgram(path: str) -> bool:
    """True if a socket file at ``path`` has nobody bound behind it (left by a crash)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe.connect(path)
        return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        probe.close()


def match_pid(pid: int) -> Callable[[Poller], bool]:
    """A process matches a PID when it is that process or a descendant of it."""
    return lambda p: pid in p.pids


class OndemandSource:
    name = "ondemand"

    def __init__(
        self,
        interval: float,
        trace_dir: str,
        socket_dir: str = "",
        control_socket: str = "",
        periodic_minutes: float = 0.0,
        keep: int = 10,
        periodic_options: kineto.TraceOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self.trace_dir = trace_dir
        self.endpoint = Endpoint(socket_dir, clock)
        self.control_socket = control_socket
        self.periodic_seconds = periodic_minutes * 60
        self.keep = keep
        self.periodic_options = periodic_options or kineto.TraceOptions(duration_ms=500)
        self._clock = clock
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._control = None
        self._tree: ProcessTree | None = None
        self._last_periodic = clock()
        self._rotation = 0
        self._own_files: list[str] = []  # files the agent itself requested (periodic mode)

    # -- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        from profagent.agent.control import ControlServer

        try:
            os.makedirs(self.trace_dir, exist_ok=True)
            os.chmod(self.trace_dir, 0o1777)  # the job may run as another user; sticky like /tmp
        except OSError as exc:
            raise SourceUnavailable(f"cannot create the on-demand trace folder {self.trace_dir} ({exc.strerror}): set ondemand.trace_dir") from None
        self.endpoint.bind()
        if self.control_socket:
            self._control = ControlServer(self.control_socket, self)
            try:
                self._control.bind()
            except SourceUnavailable:
                self.endpoint.close()
                raise
        self._spawn(lambda: self.endpoint.serve(self._stop), "kineto")
        if self._control is not None:
            self._spawn(lambda: self._control.serve(self._stop), "control")

    def _spawn(self, fn: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=fn, name=f"profagent-ondemand-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(1.0)
        self.endpoint.close()
        if self._control is not None:
            self._control.close()

    # -- requests (called by the control server) -------------------------------------
    @property
    def tree(self) -> ProcessTree | None:
        return self._tree

    def request(self, match: Callable[[Poller], bool], options: kineto.TraceOptions, timeout: float) -> TraceRequest:
        return self.endpoint.request(match, options, self.trace_dir, timeout)

    # -- tick --------------------------------------------------------------------------
    def collect(self, tree: ProcessTree) -> OndemandSnapshot:
        self._tree = tree
        if self.periodic_seconds > 0 and self._clock() - self._last_periodic >= self.periodic_seconds:
            self._last_periodic = self._clock()
            self._periodic(tree)
        self.endpoint.expire()
        by_pid = tree.by_pid()
        groups: dict[tuple[str, str, str], int] = {}
        unmatched = 0
        for poller in self.endpoint.pollers():
            info = by_pid.get(poller.pid)
            if info is None:
                unmatched += 1
                continue
            key = (info.job_id, info.rank, info.role)
            groups[key] = groups.get(key, 0) + 1
        counts = self.endpoint.counts()
        datagrams = tuple((k, counts.get(k, 0)) for k in ("poll", "ctxt", "malformed"))
        requests = tuple((k, counts.get(k, 0)) for k in ("requested", "sent", "expired"))
        return OndemandSnapshot(
            tuple((*k, n) for k, n in sorted(groups.items())), unmatched, datagrams, requests
        )

    def _periodic(self, tree: ProcessTree) -> None:
        """Continuous profiling at a bounded cost: one rank per period, in turn."""
        polling = {p.pid for p in self.endpoint.pollers() if p.can_trace}
        mains = [m for m in tree.mains() if m.pid in polling]
        if not mains:
            return
        chosen = mains[self._rotation % len(mains)]
        self._rotation += 1
        try:
            request = self.endpoint.request(lambda p: p.pid == chosen.pid, self.periodic_options,
                                            self.trace_dir, timeout=60.0, periodic=True)
        except NoPollers:
            return
        self._own_files.extend(t.file for t in request.targets.values())
        self._prune_own_files()

    def _prune_own_files(self) -> None:
        """Keep the last ``keep`` traces the agent requested; never touch any other file."""
        while len(self._own_files) > self.keep:
            path = self._own_files.pop(0)
            try:
                Path(path).unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("could not remove old periodic trace %s: %s", path, exc)


def doctor_check(config) -> Iterable:  # config: profagent.config.Config
    """Is the Kineto endpoint free, held by a profagent agent (and who polls it), or by another daemon?"""
    from profagent.agent.control import call, default_control_socket
    from profagent.doctor import OK, WARN, Check

    endpoint = Endpoint(config.ondemand.socket_dir)
    where = endpoint.describe()
    try:
        endpoint.bind()
    except SourceUnavailable:
        pass
    else:
        endpoint.close()
        yield Check("ondemand", "Kineto endpoint", OK, f"{where} is free: an agent started now will host it")
        return
    control = config.ondemand.control_socket or default_control_socket()
    try:
        reply = call(control, {"op": "registry"}, timeout=2)
    except (OSError, ValueError):
        yield Check("ondemand", "Kineto endpoint", WARN, f"{where} is held by another daemon (dynolog?)",
                    "stop it, or trace through that daemon; profagent's on-demand source stays off")
        return
    pollers = reply.get("pollers", [])
    yield Check("ondemand", "Kineto endpoint", OK, f"{where} is hosted by a running profagent agent ({control})")
    if pollers:
        names = ", ".join(f"{p['pid']}" + (f" (rank {p['rank']})" if p.get("rank") else "") for p in pollers[:8])
        yield Check("ondemand", "polling processes", OK, f"{len(pollers)}: {names}")
    else:
        yield Check("ondemand", "polling processes", WARN, "none",
                    "start training scripts with KINETO_USE_DAEMON=1 to trace them with `profagent trace`")

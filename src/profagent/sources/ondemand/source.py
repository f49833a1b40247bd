"""The `ondemand` source: host Kineto's daemon endpoint so traces need no code change.

Processes started with ``KINETO_USE_DAEMON=1`` poll the endpoint every ~5 s; each poll
registers them (a process silent for 60 s is gone). ``profagent trace`` asks, over the
agent's control socket (``engine/control.py``), for a trace of matching processes; the
next poll of each gets the config, and libkineto writes
``<trace_dir>/profagent_<id>_<pid>.json``, which the traces source ingests like any other.
In periodic mode the source itself asks one rank at a time for a short trace.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from profagent.contracts import OndemandSnapshot, ProcessTree
from profagent.errors import SourceUnavailable, SourceWaiting, UserError
from profagent.sources.ondemand import kineto
from profagent.sources.ondemand.endpoint import (
    MAX_POLLERS,
    MAX_POLLERS_PER_USER,
    RETRY_BIND_SECONDS,
    Endpoint,
    EndpointHeld,
    NoPollers,
    Poller,
    TraceRequest,
)
from profagent.system.safefs import UnsafePath, own_directory

log = logging.getLogger(__name__)



class OndemandSource:
    name = "ondemand"

    def __init__(
        self,
        interval: float,
        trace_dir: str,
        socket_dir: str = "",
        periodic_minutes: float = 0.0,
        keep: int = 10,
        periodic_options: kineto.TraceOptions | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_pollers: int = MAX_POLLERS,
        max_pollers_per_user: int = MAX_POLLERS_PER_USER,
    ) -> None:
        self.interval = interval
        self.trace_dir = trace_dir
        self.endpoint = Endpoint(socket_dir, clock, max_pollers, max_pollers_per_user)
        self.periodic_seconds = periodic_minutes * 60
        self.keep = keep
        self.periodic_options = periodic_options or kineto.TraceOptions(duration_ms=500)
        self._clock = clock
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._tree: ProcessTree | None = None
        self._last_periodic = clock()
        self._rotation = 0
        self._own_files: list[str] = []  # files the agent itself requested (periodic mode)
        self._held: EndpointHeld | None = None  # why the endpoint is not ours yet (retried)

    # -- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.trace_dir)), exist_ok=True)
            # The job may run as another user: world-writable and sticky like /tmp, but only
            # once the folder is known to be ours (a planted symlink or folder is refused).
            mode = own_directory(self.trace_dir, 0o1777)
        except UnsafePath as exc:
            raise SourceUnavailable(f"refusing the on-demand trace folder: {exc}; remove it or set ondemand.trace_dir") from None
        except OSError as exc:
            raise SourceUnavailable(f"cannot create the on-demand trace folder {self.trace_dir} ({exc.strerror}): set ondemand.trace_dir") from None
        if mode != 0o1777:  # an existing folder is used as it is, never chmod-ed
            log.warning("on-demand trace folder %s exists with mode %04o, used as it is (never changed): jobs of "
                        "other users can write traces there only if it is 1777; set ondemand.trace_dir to a folder "
                        "the agent creates", self.trace_dir, mode)
        try:
            self.endpoint.bind()
        except EndpointHeld as exc:
            # Refusing to serve a hostile endpoint is right; refusing to run is not: a
            # process of any user could keep the node unmonitored by binding it first.
            log.warning("%s", exc)
            self._held = exc
            self._spawn(self._retry_bind, "bind")
            raise
        self._serve()

    def _serve(self) -> None:
        if problem := kineto.socket_dir_problem(self.endpoint.socket_dir):
            log.warning("%s; %s", problem, kineto.SOCKET_DIR_FIX)  # the agent's own socket fits; the jobs' would not
        self._spawn(lambda: self.endpoint.serve(self._stop), "kineto")

    def _retry_bind(self) -> None:
        """Try the held endpoint every RETRY_BIND_SECONDS until it is ours or the agent stops."""
        while not self._stop.wait(RETRY_BIND_SECONDS):
            try:
                self.endpoint.bind()
            except EndpointHeld as exc:
                self._held = exc  # its holder may have changed: the health line says the latest
                continue
            except SourceUnavailable as exc:  # a root daemon took it meanwhile, or a bind failure
                self._held = EndpointHeld(str(exc), "profagent tries it again until it can bind it")
                continue
            if self._stop.is_set():
                self.endpoint.close()
                return
            log.warning("the Kineto endpoint %s is free now and profagent's: on-demand tracing on",
                        self.endpoint.describe())
            self._serve()
            self._held = None
            return

    def _spawn(self, fn: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=fn, name=f"profagent-ondemand-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(1.0)
        self.endpoint.close()

    # -- requests (called by the control server) -------------------------------------
    @property
    def tree(self) -> ProcessTree | None:
        return self._tree

    def request(self, match: Callable[[Poller], bool], options: kineto.TraceOptions, timeout: float) -> TraceRequest:
        held = self._held
        if held is not None:
            raise UserError(held.problem, held.fix)
        return self.endpoint.request(match, options, self.trace_dir, timeout)

    # -- tick --------------------------------------------------------------------------
    def collect(self, tree: ProcessTree) -> OndemandSnapshot:
        self._tree = tree
        held = self._held
        if held is not None:
            raise SourceWaiting(str(held), held.why)
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
        datagrams = tuple((k, counts.get(k, 0)) for k in ("poll", "ctxt", "malformed", "rate_limited"))
        requests = tuple((k, counts.get(k, 0)) for k in ("requested", "sent", "resent", "expired"))
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

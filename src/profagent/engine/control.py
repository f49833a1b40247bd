"""The local control channel of a running agent, used by `profagent trace` and `doctor`.

A Unix stream socket with 0600 permissions (only the agent's user, usually root, can
ask for traces); one JSON request line in, one JSON reply line out. It is never
exposed on the network.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from profagent.contracts import ROLE_LAUNCHER, ROLE_MAIN
from profagent.errors import NotApplicable, SourceUnavailable, SourceWaiting
from profagent.sources.ondemand import kineto
from profagent.sources.ondemand.endpoint import NoPollers, Poller, match_pid
from profagent.system.safefs import UnsafePath, own_directory
from profagent.system.unixsock import bind_private, call, close_unix_socket

if TYPE_CHECKING:
    from profagent.contracts import OndemandSnapshot, ProcessTree
    from profagent.sources.ondemand.source import OndemandSource

log = logging.getLogger(__name__)
MAX_LINE = 64 * 1024
ONDEMAND_OPS = ("registry", "status", "trace")  # need the on-demand source; "ping" and the engine's do not


class ControlServer:
    """``source`` None: on-demand tracing is off in this agent (``off_reason`` says why),
    and the socket serves the engine's own ops (``incident``) alone."""

    def __init__(self, path: str, source: OndemandSource | None, off_reason: str = "") -> None:
        self.path = path
        self.source = source
        self.off_reason = off_reason
        self._sock: socket.socket | None = None
        # More ops from the engine: name -> handler(request) -> reply (e.g. "incident").
        self.handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind, then serve in a thread. Raises SourceUnavailable (NotApplicable when
        another live agent holds the socket) or OSError."""
        self.bind()
        self._stop.clear()
        self._thread = threading.Thread(target=self.serve, args=(self._stop,), name="profagent-control", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
        self.close()

    def bind(self) -> None:
        """Raises SourceUnavailable when another live agent already holds the socket."""
        path = Path(self.path)
        path.parent.parent.mkdir(parents=True, exist_ok=True)
        try:  # e.g. /tmp/profagent-<uid>: a folder another user created first is not ours
            own_directory(str(path.parent), 0o700)
        except UnsafePath as exc:
            raise SourceUnavailable(f"refusing the control socket folder: {exc}; remove it or set ondemand.control_socket") from None
        if path.exists():
            try:
                call(self.path, {"op": "ping"}, timeout=1)
                raise NotApplicable(
                    f"another profagent already serves on-demand traces here ({self.path}): "
                    "on-demand tracing off for this agent; stop the other one or set ondemand.control_socket",
                    "held_by_another_agent",
                )
            except (OSError, ValueError):
                path.unlink()  # our own stale socket from a crash
        sock = bind_private(self.path)
        sock.listen(8)
        sock.settimeout(0.2)
        self._sock = sock

    @property
    def bound(self) -> bool:
        return self._sock is not None

    def close(self) -> None:
        close_unix_socket(self._sock, self.path)
        self._sock = None

    def serve(self, stop: threading.Event) -> None:
        while not stop.is_set() and self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    line = conn.makefile("rb").readline(MAX_LINE)
                    reply = self.handle(json.loads(line))
                except (OSError, ValueError) as exc:
                    reply = {"ok": False, "error": f"bad request: {exc}"}
                try:
                    conn.sendall(json.dumps(reply).encode() + b"\n")
                except OSError:
                    pass

    # -- requests -----------------------------------------------------------------------
    def _describe(self, poller: Poller) -> dict[str, Any]:
        tree = self.source.tree
        info = tree.by_pid().get(poller.pid) if tree else None
        return {
            "pid": poller.pid,
            "pids": list(poller.pids),
            "jobid": poller.jobid,
            "can_trace": poller.can_trace,
            "job_id": info.job_id if info else "",
            "rank": info.rank if info else "",
            "role": info.role if info else "",
        }

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "ping":
            return {"ok": True}
        if op in ONDEMAND_OPS and self.source is None:
            return {"ok": False, "error": "ondemand_off", "reason": self.off_reason, "agent_pid": os.getpid()}
        if op == "registry":
            return {"ok": True, "pollers": [self._describe(p) for p in self.source.endpoint.pollers()],
                    "trace_dir": self.source.trace_dir}
        if op == "status":
            request = self.source.endpoint.get(str(req.get("id")))
            if request is None:
                return {"ok": False, "error": "unknown request id"}
            return {"ok": True, "targets": [
                {"pid": t.pid, "file": t.file, "sent": t.sent_at is not None, "resent": t.resent}
                for t in request.targets.values()
            ]}
        if op == "trace":
            try:
                options = kineto.TraceOptions(
                    duration_ms=int(req.get("duration_ms") or 500),
                    iterations=int(req.get("iterations") or 0),
                    record_shapes=bool(req.get("record_shapes")),
                    profile_memory=bool(req.get("profile_memory")),
                    with_stack=bool(req.get("with_stack")),
                )
                timeout = float(req.get("timeout") or 60)
            except (TypeError, ValueError) as exc:
                return {"ok": False, "error": f"bad trace options: {exc}"}
            tree = self.source.tree
            # A launcher (torchrun) started with KINETO_USE_DAEMON=1 polls too, but its trace
            # is empty: --pid and --job trace the ranks (role main), the process asked for
            # unless it is the launcher, and a process the tree does not know.
            roles = {p.pid: p.role for p in tree.processes} if tree else {}
            if req.get("pid") is not None:
                pid = int(req["pid"])
                under = match_pid(pid)
                match = lambda p: under(p) and (  # noqa: E731
                    roles.get(p.pid, ROLE_MAIN) == ROLE_MAIN or (p.pid == pid and roles.get(pid) != ROLE_LAUNCHER))
            elif req.get("job") is not None:
                job = str(req["job"])
                ranks = {p.pid for p in tree.processes if p.job_id == job and p.role == ROLE_MAIN} if tree else set()
                match = lambda p: p.pid in ranks  # noqa: E731
            else:  # --all: every process polling, as its help says
                match = lambda p: True  # noqa: E731
            try:
                request = self.source.request(match, options, timeout)
            except NoPollers:
                pollers = [self._describe(p) for p in self.source.endpoint.pollers()]
                jobs = sorted({p.job_id for p in tree.processes if p.job_id}) if tree else []
                if req.get("job") is not None and str(req["job"]) not in jobs:
                    # Several agents on one node: this one holds the Kineto endpoint (every
                    # job's ranks poll it) but watches other jobs, so it cannot tell which
                    # pollers belong to the job asked for.
                    return {"ok": False, "error": "job_not_watched", "agent_pid": os.getpid(),
                            "agent_jobs": jobs, "pollers": pollers}
                return {"ok": False, "error": "no_pollers", "pollers": pollers}
            return {"ok": True, "id": request.id, "targets": [
                {**self._describe_pid(t.pid), "file": t.file} for t in request.targets.values()
            ]}
        handler = self.handlers.get(str(op))
        if handler is not None:
            return handler(req)
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _describe_pid(self, pid: int) -> dict[str, Any]:
        tree = self.source.tree
        info = tree.by_pid().get(pid) if tree else None
        return {"pid": pid, "job_id": info.job_id if info else "", "rank": info.rank if info else ""}


class ControlledOndemand:
    """The on-demand source with the agent's control server beside it.

    The source hosts the Kineto endpoint; the engine adds the control socket through
    which `profagent trace` reaches it. Both start and stop together: when another live
    agent holds the control socket, the source is turned off with that reason.
    """

    def __init__(self, source: OndemandSource, control_socket: str) -> None:
        self.source = source
        self.name = source.name
        self.interval = source.interval
        self.control = ControlServer(control_socket, source)

    def start(self) -> None:
        waiting = None
        try:
            self.source.start()
        except SourceWaiting as exc:  # the endpoint is retried; `profagent trace` is told why meanwhile
            waiting = exc
        try:
            self.control.start()
        except SourceUnavailable:
            self.source.stop()
            raise
        if waiting is not None:
            raise waiting

    def collect(self, tree: ProcessTree) -> OndemandSnapshot:
        return self.source.collect(tree)

    def stop(self) -> None:
        self.control.stop()
        self.source.stop()


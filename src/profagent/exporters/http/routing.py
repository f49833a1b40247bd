"""Routing: what each path answers (/metrics, /healthz, the routes added by the API), the
basic-auth gate in front of them, and the server that binds the port and hands requests to
serving.py's event loop.
"""

from __future__ import annotations

import errno
import gzip
import io
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlsplit

from profagent.errors import UserError
from profagent.exporters.exposition import Exposition
from profagent.exporters.http.auth import Authenticator, client_key
from profagent.exporters.http.serving import Chunks, EventServer, HttpLimits
from profagent.exporters.webconfig import WebConfig, peer_check, ssl_context
from profagent.labels import printable

log = logging.getLogger(__name__)

# A route gets the parsed query string and returns (status, content type, body).
Route = Callable[[dict[str, list[str]]], tuple[int, str, bytes]]


class AgentHTTPServer:
    """Serves /metrics and /healthz, plus routes added with ``add_route``."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics: Exposition,
        web_config: WebConfig | None = None,
        limits: HttpLimits | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.render_metrics = metrics.render
        self.web_config = web_config or WebConfig()
        self.limits = limits or HttpLimits()
        # Cleared by an owner while its sources start: /healthz then answers 503 "starting",
        # so nobody reads a half-started agent as ready.
        self.ready = threading.Event()
        self.ready.set()
        self.routes: dict[str, Route] = {"/healthz": self._healthz}
        self._server: EventServer | None = None
        # one line per collector ("ondemand: off (retrying: endpoint_held): ..."), for ?verbose=1
        self.health_detail: Callable[[], list[str]] | None = None

    def _healthz(self, query: dict[str, list[str]]) -> tuple[int, str, bytes]:
        """"ok" once started ("starting", 503, before); ``?verbose=1`` adds a line per collector:
        the agent serves while a collector is off, and this says which and why."""
        head = "ok\n" if self.ready.is_set() else "starting\n"
        lines = self.health_detail() if "verbose" in query and self.health_detail is not None else []
        body = (head + "".join(printable(line) + "\n" for line in lines)).encode()
        return (200 if self.ready.is_set() else 503), "text/plain", body

    def add_route(self, path: str, route: Route) -> None:
        self.routes[path] = route

    @property
    def refused(self) -> dict[str, int]:
        """Connections closed by a cap, per reason (per_client, evicted, deadline, too_large, tls, output)."""
        return dict(self._server.refused) if self._server else {}

    @property
    def url(self) -> str:
        scheme = "https" if self.web_config.tls else "http"
        host = self.host if self.host not in ("0.0.0.0", "::") else socket.gethostname()
        if ":" in host:
            host = f"[{host}]"
        return f"{scheme}://{host}:{self.port}/metrics"

    def start(self) -> None:
        """Bind and serve in a thread. Raises UserError if the port is taken or not allowed."""
        ctx = ssl_context(self.web_config) if self.web_config.tls else None
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self.port))
            listener.listen(128)
        except OSError as exc:
            listener.close()
            if exc.errno == errno.EADDRINUSE:
                raise UserError(
                    f"port {self.port} on {self.host} is already in use",
                    "stop the other process or choose another port with --listen HOST:PORT",
                ) from None
            if exc.errno == errno.EACCES:
                raise UserError(f"not permitted to listen on port {self.port}", "use a port above 1023 or run as root") from None
            raise UserError(f"cannot listen on {self.host}:{self.port} ({exc.strerror})", "check --listen") from None
        self.port = listener.getsockname()[1]  # resolves port 0
        auth = Authenticator(self.web_config.users, self.limits.auth_backoff_max)
        self._server = EventServer(listener, _make_handler(self, auth), self.limits, ctx, auth, peer_check(self.web_config))
        self._server.start()

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


def _make_handler(server: AgentHTTPServer, auth: Authenticator) -> type[BaseHTTPRequestHandler]:
    headers_out = dict(server.web_config.headers)

    class Handler(BaseHTTPRequestHandler):
        """Answers one whole, already-read request into a buffer; the I/O thread sends it."""

        protocol_version = "HTTP/1.1"
        hold = 0.0  # seconds the I/O thread holds this answer (failed logins)

        def setup(self) -> None:
            self.connection, request = self.request
            self.rfile = io.BytesIO(request)
            self.wfile = Chunks()

        def handle(self) -> None:
            self.close_connection = True
            self.handle_one_request()

        def finish(self) -> None:
            pass

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            log.debug("http: " + format, *args)

        def end_headers(self) -> None:
            for k, v in headers_out.items():
                self.send_header(k, v)
            super().end_headers()

        def _send(self, status: int, ctype: str, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self) -> None:  # noqa: N802
            self.do_GET()

        def do_GET(self) -> None:  # noqa: N802
            if not auth.check(self.headers.get("Authorization")):
                if self.headers.get("Authorization"):
                    self.hold = auth.failed(client_key(str(self.client_address[0])))
                self._send(401, "text/plain", b"Unauthorized\n", {"WWW-Authenticate": 'Basic realm="profagent"'})
                return
            url = urlsplit(self.path)
            try:
                if url.path == "/metrics":
                    body, ctype = server.render_metrics(self.headers.get("Accept", ""))
                    headers = {}
                    if "gzip" in self.headers.get("Accept-Encoding", ""):
                        body = gzip.compress(body, compresslevel=1)
                        headers["Content-Encoding"] = "gzip"
                    self._send(200, ctype, body, headers)
                elif url.path in server.routes:
                    status, ctype, body = server.routes[url.path](parse_qs(url.query))
                    self._send(status, ctype, body)
                elif url.path == "/":
                    links = "".join(f'<li><a href="{p}">{p}</a></li>' for p in ["/metrics", *server.routes])
                    self._send(200, "text/html", f"<h1>profagent</h1><ul>{links}</ul>".encode())
                else:
                    self._send(404, "text/plain", b"not found\n")
            except Exception as exc:  # a broken route must not kill the server
                log.warning("serving %s failed: %s", url.path, exc)
                self._send(500, "text/plain", f"error: {exc}\n".encode())

    return Handler

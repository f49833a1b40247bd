"""The agent's HTTP endpoint: /metrics, /healthz and small read-only APIs.

TLS and basic auth come from an exporter-toolkit ``web-config.yml`` (the file
node_exporter users already have): ``tls_server_config.cert_file/key_file`` (optionally
``client_ca_file`` + ``client_auth_type``) and ``basic_auth_users`` with bcrypt hashes.

The endpoint may face the network: every connection has a timeout, at most
``MAX_CONNECTIONS`` are served at once (more are closed at once), and a client that keeps
failing basic auth is answered 429 without spending bcrypt time on it.
"""

from __future__ import annotations

import base64
import errno
import gzip
import hashlib
import hmac
import logging
import socket
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import bcrypt
import yaml

from profagent.errors import UserError
from profagent.exporters.exposition import Exposition

log = logging.getLogger(__name__)

# A route gets the parsed query string and returns (status, content type, body).
Route = Callable[[dict[str, list[str]]], tuple[int, str, bytes]]

CONNECTION_TIMEOUT = 10.0  # seconds a connection may stay silent (half-sent request, idle keep-alive)
MAX_CONNECTIONS = 32  # handler threads; Prometheus needs one or two
AUTH_FAILURES_ALLOWED = 10  # per client address and window, then 429 until the window ends
AUTH_WINDOW = 60.0
AUTH_CLIENTS_TRACKED = 4096  # oldest forgotten first: memory stays bounded under a spray

_CLIENT_AUTH = {
    "": ssl.CERT_NONE,
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_OPTIONAL,
    "RequireAnyClientCert": ssl.CERT_REQUIRED,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}


@dataclass(frozen=True)
class WebConfig:
    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""
    client_auth_type: str = ""
    users: dict[str, bytes] = field(default_factory=dict)

    @property
    def tls(self) -> bool:
        return bool(self.cert_file)


def load_web_config(path: str | Path) -> WebConfig:
    """Parse web-config.yml. Raises UserError when it is unreadable or malformed."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise UserError(f"web config {path} not found", "check the --web-config path") from None
    except IsADirectoryError:
        raise UserError(f"web config {path} is a directory", "pass the web-config.yml file itself") from None
    except PermissionError:
        raise UserError(f"cannot read web config {path}", "fix its permissions") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read web config {path} ({exc})", "pass a readable YAML file") from None
    except yaml.YAMLError as exc:
        detail = str(exc).splitlines()[0]
        raise UserError(f"malformed web config {path} ({detail})", "fix the YAML syntax") from None
    if not isinstance(data, dict):
        raise UserError(f"malformed web config {path}", "expected tls_server_config and/or basic_auth_users")
    unknown = set(data) - {"tls_server_config", "basic_auth_users", "http_server_config"}
    if unknown:
        raise UserError(
            f"unknown key '{sorted(unknown)[0]}' in web config {path}",
            "supported: tls_server_config, basic_auth_users, http_server_config",
        )
    tls = data.get("tls_server_config") or {}
    users = data.get("basic_auth_users") or {}
    if not isinstance(tls, dict) or not isinstance(users, dict):
        raise UserError(f"malformed web config {path}", "tls_server_config and basic_auth_users are mappings")
    cert, key = str(tls.get("cert_file", "")), str(tls.get("key_file", ""))
    if bool(cert) != bool(key):
        raise UserError(f"web config {path} sets only one of cert_file/key_file", "set both")
    auth_type = str(tls.get("client_auth_type", ""))
    if auth_type not in _CLIENT_AUTH:
        raise UserError(f"unknown client_auth_type {auth_type!r} in {path}", f"use one of {', '.join(k for k in _CLIENT_AUTH if k)}")
    base = path.parent

    def resolve(p: str) -> str:  # relative paths are relative to the web config, as in exporter-toolkit
        return str(base / p) if p and not Path(p).is_absolute() else p

    for user, hashed in users.items():
        if not str(hashed).startswith("$2"):
            raise UserError(f"password of user {user!r} in {path} is not a bcrypt hash", "generate one with `htpasswd -nBC 10 USER`")
        try:  # a malformed hash would otherwise fail on every authenticated request
            bcrypt.checkpw(b"", str(hashed).encode())
        except ValueError:
            raise UserError(f"the bcrypt hash of user {user!r} in {path} is malformed", "generate one with `htpasswd -nBC 10 USER`") from None
    verified = auth_type in ("RequireAndVerifyClientCert", "VerifyClientCertIfGiven")
    if verified and not tls.get("client_ca_file"):
        raise UserError(f"client_auth_type {auth_type} in {path} needs client_ca_file", "set client_ca_file to the CA that signs client certificates")
    if auth_type and auth_type != "NoClientCert" and not cert:
        raise UserError(f"client_auth_type in {path} needs TLS", "set cert_file and key_file")
    return WebConfig(
        cert_file=resolve(cert),
        key_file=resolve(key),
        client_ca_file=resolve(str(tls.get("client_ca_file", ""))),
        client_auth_type=auth_type,
        users={str(u): str(h).encode() for u, h in users.items()},
    )


def _ssl_context(cfg: WebConfig) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        if cfg.client_ca_file:
            ctx.load_verify_locations(cfg.client_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise UserError(f"cannot load TLS certificate or key ({exc})", "check cert_file/key_file in the web config") from None
    ctx.verify_mode = _CLIENT_AUTH[cfg.client_auth_type]
    return ctx


class _Authenticator:
    """bcrypt is deliberately slow, so successful checks are remembered (as node_exporter
    does), and a client address failing too often is refused before bcrypt runs."""

    def __init__(self, users: dict[str, bytes], clock: Callable[[], float] = time.monotonic) -> None:
        self._users = users
        self._ok: set[bytes] = set()
        self._lock = threading.Lock()
        self._clock = clock
        self._failures: OrderedDict[str, tuple[float, int]] = OrderedDict()  # client -> (window start, count)

    def throttled(self, client: str) -> bool:
        """True while ``client`` has failed more than AUTH_FAILURES_ALLOWED times this window."""
        if not self._users:
            return False
        with self._lock:
            entry = self._failures.get(client)
            if entry is None:
                return False
            if self._clock() - entry[0] >= AUTH_WINDOW:
                del self._failures[client]
                return False
            return entry[1] >= AUTH_FAILURES_ALLOWED

    def failed(self, client: str) -> None:
        now = self._clock()
        with self._lock:
            start, count = self._failures.pop(client, (now, 0))
            if now - start >= AUTH_WINDOW:
                start, count = now, 0
            self._failures[client] = (start, count + 1)
            while len(self._failures) > AUTH_CLIENTS_TRACKED:
                self._failures.popitem(last=False)

    def check(self, header: str | None) -> bool:
        if not self._users:
            return True
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:]).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        hashed = self._users.get(user)
        if hashed is None:
            return False
        token = hashlib.sha256(hashed + b"\0" + password.encode()).digest()
        with self._lock:
            if any(hmac.compare_digest(token, t) for t in self._ok):
                return True
        if not bcrypt.checkpw(password.encode(), hashed):
            return False
        with self._lock:
            self._ok.add(token)
        return True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    ssl_context: ssl.SSLContext | None = None
    request_queue_size = 64
    slots = threading.BoundedSemaphore(MAX_CONNECTIONS)  # replaced per server in AgentHTTPServer.start
    refused = 0

    def process_request(self, request, client_address):  # type: ignore[override]
        if not self.slots.acquire(blocking=False):
            self.refused += 1  # over the cap: closed at once, no thread
            if self.refused % 100 == 1:
                log.warning("more than %d HTTP connections at once: closing new ones (%d so far)", MAX_CONNECTIONS, self.refused)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):  # type: ignore[override]
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def finish_request(self, request, client_address):  # type: ignore[override]
        if self.ssl_context is not None:
            # Handshake in the request thread, so a slow client cannot stall accept().
            request.settimeout(CONNECTION_TIMEOUT)
            try:
                request = self.ssl_context.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError) as exc:
                log.debug("TLS handshake from %s failed: %s", client_address, exc)
                return
        super().finish_request(request, client_address)


class AgentHTTPServer:
    """Serves /metrics and /healthz, plus routes added with ``add_route``."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics: Exposition,
        web_config: WebConfig | None = None,
    ) -> None:
        self.host, self.port = host, port
        self.render_metrics = metrics.render
        self.web_config = web_config or WebConfig()
        # Cleared by an owner while its sources start: /healthz then answers 503 "starting",
        # so nobody reads a half-started agent as ready.
        self.ready = threading.Event()
        self.ready.set()
        self.routes: dict[str, Route] = {"/healthz": self._healthz}
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    def _healthz(self, query: dict[str, list[str]]) -> tuple[int, str, bytes]:
        return (200, "text/plain", b"ok\n") if self.ready.is_set() else (503, "text/plain", b"starting\n")

    def add_route(self, path: str, route: Route) -> None:
        self.routes[path] = route

    @property
    def url(self) -> str:
        scheme = "https" if self.web_config.tls else "http"
        host = self.host if self.host not in ("0.0.0.0", "::") else socket.gethostname()
        if ":" in host:
            host = f"[{host}]"
        return f"{scheme}://{host}:{self.port}/metrics"

    def start(self) -> None:
        """Bind and serve in a thread. Raises UserError if the port is taken or not allowed."""
        handler = _make_handler(self)
        server_cls = _Server
        if ":" in self.host:
            server_cls = type("_Server6", (_Server,), {"address_family": socket.AF_INET6})
        try:
            httpd = server_cls((self.host, self.port), handler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UserError(
                    f"port {self.port} on {self.host} is already in use",
                    "stop the other process or choose another port with --listen HOST:PORT",
                ) from None
            if exc.errno == errno.EACCES:
                raise UserError(f"not permitted to listen on port {self.port}", "use a port above 1023 or run as root") from None
            raise UserError(f"cannot listen on {self.host}:{self.port} ({exc.strerror})", "check --listen") from None
        httpd.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        if self.web_config.tls:
            httpd.ssl_context = _ssl_context(self.web_config)
        self.port = httpd.server_address[1]  # resolves port 0
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="profagent-http", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None


def _make_handler(server: AgentHTTPServer) -> type[BaseHTTPRequestHandler]:
    auth = _Authenticator(server.web_config.users)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = CONNECTION_TIMEOUT  # a half-sent request or an idle keep-alive is closed

        def setup(self) -> None:
            super().setup()
            # Headers and body go out as two writes; without NODELAY, Nagle + delayed ACK
            # add ~40 ms to every keep-alive scrape.
            try:
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            log.debug("http: " + format, *args)

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
            client = self.client_address[0]
            if auth.throttled(client):
                self._send(429, "text/plain", b"too many failed logins; retry later\n", {"Retry-After": str(int(AUTH_WINDOW))})
                return
            if not auth.check(self.headers.get("Authorization")):
                if self.headers.get("Authorization"):
                    auth.failed(client)
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
            except (BrokenPipeError, ConnectionResetError):
                pass
            except Exception as exc:  # a broken route must not kill the server
                log.warning("serving %s failed: %s", url.path, exc)
                self._send(500, "text/plain", f"error: {exc}\n".encode())

    return Handler

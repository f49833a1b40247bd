"""The HTTP endpoint against hostile clients: half-sent requests, connection floods,
password guessing, and web-configs that would only fail later."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest

from helpers.processes import wait_for
from profagent.errors import UserError
from profagent.exporters import http as http_module
from profagent.exporters.exposition import Exposition
from profagent.exporters.http import AgentHTTPServer, WebConfig, load_web_config
from profagent.state import State

HASH = bcrypt.hashpw(b"right", bcrypt.gensalt(rounds=10))


def _server(monkeypatch, users: dict[str, bytes] | None = None, timeout: float = 2.0) -> AgentHTTPServer:
    monkeypatch.setattr(http_module, "CONNECTION_TIMEOUT", timeout)
    server = AgentHTTPServer("127.0.0.1", 0, Exposition(State().view), WebConfig(users=users or {}))
    server.start()
    return server


def _get(server: AgentHTTPServer, password: str | None = None, source: str = "127.0.0.1") -> int:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30, source_address=(source, 0)) as s:
        auth = f"Authorization: Basic {base64.b64encode(f'u:{password}'.encode()).decode()}\r\n" if password else ""
        s.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n".encode())
        head = s.recv(64).decode()
    return int(head.split()[1])


def test_half_open_connections_are_capped_and_timed_out(monkeypatch) -> None:
    server = _server(monkeypatch)
    try:
        before = threading.active_count()
        attackers = []
        for _ in range(200):  # each sends half a request line and then nothing
            s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x")
            attackers.append(s)
        wait_for(lambda: server._httpd.refused > 0, 30, what="connections over the cap refused")
        peak = threading.active_count() - before
        assert peak <= http_module.MAX_CONNECTIONS + 1, f"{peak} handler threads for 200 half-open connections"

        def all_closed() -> bool:  # the server hangs up on each (timeout or over the cap)
            for s in attackers:
                try:
                    if s.recv(1) != b"":
                        return False
                except (TimeoutError, ConnectionResetError):
                    continue
            return True

        for s in attackers:
            s.settimeout(0.05)
        wait_for(all_closed, 60, interval=0.5, what="half-open connections closed by the server")
        wait_for(lambda: threading.active_count() <= before, 30, what="handler threads gone")
        assert _get(server) == 200  # and a real scrape works again
        for s in attackers:
            s.close()
    finally:
        server.shutdown()


def test_password_guessing_is_throttled_per_client(monkeypatch) -> None:
    checks: list[int] = []
    real = bcrypt.checkpw

    def counting(password: bytes, hashed: bytes) -> bool:
        checks.append(1)
        return real(password, hashed)

    monkeypatch.setattr(http_module.bcrypt, "checkpw", counting)
    server = _server(monkeypatch, {"u": HASH})
    try:
        statuses = [_get(server, f"guess{i}") for i in range(40)]
        assert statuses[: http_module.AUTH_FAILURES_ALLOWED] == [401] * http_module.AUTH_FAILURES_ALLOWED
        assert set(statuses[http_module.AUTH_FAILURES_ALLOWED :]) == {429}
        assert len(checks) == http_module.AUTH_FAILURES_ALLOWED  # no bcrypt time spent on the rest
        assert _get(server, "right", source="127.0.0.2") == 200  # another client is not locked out
    finally:
        server.shutdown()


def test_throttle_memory_is_bounded(monkeypatch) -> None:
    now = [0.0]
    auth = http_module._Authenticator({"u": HASH}, clock=lambda: now[0])
    for i in range(http_module.AUTH_CLIENTS_TRACKED * 3):
        auth.failed(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}")
    assert len(auth._failures) == http_module.AUTH_CLIENTS_TRACKED
    for _ in range(http_module.AUTH_FAILURES_ALLOWED):
        auth.failed("10.9.9.9")
    assert auth.throttled("10.9.9.9")
    now[0] += http_module.AUTH_WINDOW
    assert not auth.throttled("10.9.9.9")  # the window ends


@pytest.mark.parametrize(("content", "words"), [
    ("basic_auth_users:\n  u: '$2b$10$notavalidbcrypthash'\n", "malformed"),
    ("tls_server_config:\n  cert_file: c.pem\n  key_file: k.pem\n  client_auth_type: RequireAndVerifyClientCert\n", "client_ca_file"),
])
def test_web_config_checked_at_start(tmp_path: Path, content: str, words: str) -> None:
    path = tmp_path / "web.yml"
    path.write_text(content)
    with pytest.raises(UserError) as exc:
        load_web_config(path)
    assert words in str(exc.value)


def test_cli_refuses_bad_web_config_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "web.yml"
    bad.write_text("basic_auth_users:\n  u: '$2b$10$notavalidbcrypthash'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for web in (bad, tmp_path):  # a malformed hash, a directory
        res = subprocess.run([sys.executable, "-m", "profagent", "attach", "--pid", str(os.getpid()), "--listen",
                              "127.0.0.1:0", "--no-stacks", "--web-config", str(web)],
                             capture_output=True, text=True, timeout=120, env=env)
        assert res.returncode == 2, res.stderr
        assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert str(web) in res.stderr


def test_urllib_sanity(monkeypatch) -> None:
    """The server under test is a real HTTP server (urllib talks to it as Prometheus would)."""
    server = _server(monkeypatch, {"u": HASH})
    try:
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30)
        assert exc.value.code == 401
    finally:
        server.shutdown()

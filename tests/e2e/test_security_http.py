"""The HTTP endpoint against hostile clients: half-sent requests, connection floods,
password guessing, and web-configs that would only fail later."""

from __future__ import annotations

import base64
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest

from helpers.agent import AgentProcess, free_port, http_get
from helpers.processes import threads, wait_for
from profagent.errors import UserError
from profagent.exporters.exposition import Exposition
from profagent.exporters.http import AgentHTTPServer, HttpLimits, WebConfig, load_web_config
from profagent.exporters.http import auth as http_auth
from profagent.exporters.http import serving as http_serving
from profagent.state import State

HASH = bcrypt.hashpw(b"right", bcrypt.gensalt(rounds=10))
NOBODY = 65534
as_root_with_setpriv = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                          reason="plays a root agent against an unprivileged user: needs root and setpriv")


def _server(users: dict[str, bytes] | None = None, **limits) -> AgentHTTPServer:
    server = AgentHTTPServer("127.0.0.1", 0, Exposition(State().view), WebConfig(users=users or {}), HttpLimits(**limits))
    server.start()
    return server


def _get(server: AgentHTTPServer, password: str | None = None, source: str = "127.0.0.1", user: str = "u") -> int:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30, source_address=(source, 0)) as s:
        auth = f"Authorization: Basic {base64.b64encode(f'{user}:{password}'.encode()).decode()}\r\n" if password else ""
        s.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n".encode())
        head = s.recv(64).decode()
    return int(head.split()[1])


def _closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except (TimeoutError, BlockingIOError):
        return False
    except ConnectionResetError:
        return True


def test_whole_request_deadline_closes_a_trickling_client() -> None:
    """A client that keeps sending (one header byte every 0.2 s, so no single read ever
    waits long) is still closed once the whole request has taken longer than the deadline."""
    server = _server(request_deadline=1.0)
    try:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        start, sent = time.monotonic(), 0
        s.settimeout(0.2)
        while not _closed_by_server(s):
            try:
                s.sendall(b"X")
                sent += 1
            except (BrokenPipeError, ConnectionResetError):
                break
            assert time.monotonic() - start < 60, "the trickling client was never closed"
        assert sent >= 3  # it kept talking, and was closed anyway
        assert server.refused["deadline"] >= 1
        s.close()
        assert _get(server) == 200
    finally:
        server.shutdown()


def test_connections_per_client_are_capped() -> None:
    """A client at its cap gets a new connection only by losing its slowest one, so a
    scrape from an address an attacker shares (loopback) is still served."""
    server = _server(max_connections_per_client=4)
    held = []
    try:
        for _ in range(4):
            held.append(socket.create_connection(("127.0.0.1", server.port), timeout=30, source_address=("127.0.0.5", 0)))
            held[-1].sendall(b"GET /metrics HTTP/1.1\r\n")
        wait_for(lambda: len(server._server._conns) == 4, 30, what="4 slow connections held")
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=30, source_address=("127.0.0.5", 0))
        held[0].settimeout(30)
        assert held[0].recv(1) == b""  # the oldest of that client is closed
        assert server.refused["per_client"] == 1
        wait_for(lambda: len(server._server._conns) == 4, 30, what="still 4 connections from that client")
        assert _get(server, source="127.0.0.5") == 200  # a prompt request from the same address is served
        assert _get(server, source="127.0.0.6") == 200  # and another client is not affected
        assert server.refused["per_client"] == 2
        extra.close()
    finally:
        for s in held:
            s.close()
        server.shutdown()


def test_at_the_cap_a_connection_that_sent_nothing_yet_goes_after_those_that_began() -> None:
    """In a fresh clone, under the slowloris test, a scrape from the attacker's address was
    closed before it had sent its request (the next connections of the attacker each closed
    the oldest). A client that has begun a request and not finished it goes first, though
    younger."""
    server = _server(max_connections_per_client=4, request_deadline=60.0)

    def connect() -> socket.socket:
        return socket.create_connection(("127.0.0.1", server.port), timeout=30, source_address=("127.0.0.5", 0))

    quiet = [connect()]  # connected, nothing sent yet: the oldest
    wait_for(lambda: len(server._server._conns) == 1, 30, what="the quiet connection accepted")
    held = []
    try:
        for _ in range(3):
            held.append(connect())
            held[-1].sendall(b"GET /metrics HTTP/1.1\r\n")
        wait_for(lambda: sum(bool(c.buf) for c in list(server._server._conns.values())) == 3, 30,
                 what="3 begun requests read")
        for n in (1, 2):  # each new connection closes the oldest begun request, not the quiet one
            quiet.append(connect())
            held[n - 1].settimeout(30)
            assert _closed_by_server(held[n - 1]), n
            assert server.refused["per_client"] == n
        quiet[0].settimeout(0.2)
        assert not _closed_by_server(quiet[0])
        quiet[0].settimeout(30)
        quiet[0].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert quiet[0].recv(64).startswith(b"HTTP/1.1 200")
    finally:
        for s in (*held, *quiet):
            s.close()
        server.shutdown()


def test_connection_cap_closes_the_slowest_to_make_room() -> None:
    server = _server(max_connections=8, max_connections_per_client=100)
    try:
        slow: list[socket.socket] = []

        def one_more_slow() -> None:
            slow.append(socket.create_connection(("127.0.0.1", server.port), timeout=30))
            slow[-1].sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            wait_for(lambda: len(server._server._conns) == min(len(slow), 8), 30, what="slow connections held")

        for _ in range(8):
            one_more_slow()
        for _ in range(5):  # at the cap, each scrape closes the oldest slow client to make room
            assert _get(server) == 200
            one_more_slow()
        assert server.refused["evicted"] == 5
        for s in slow[:5]:
            s.settimeout(30)
            assert _closed_by_server(s)
        for s in slow:
            s.close()
    finally:
        server.shutdown()


def test_answers_not_taken_by_their_clients_are_bounded(monkeypatch) -> None:
    """Clients that ask for a big answer and never read it cannot make the agent hold
    more than MAX_PENDING_OUTPUT (plus the newest answer): the slowest are closed."""
    monkeypatch.setattr(http_serving, "MAX_PENDING_OUTPUT", 16 * 1024**2)
    server = _server(max_connections_per_client=100)
    big = b"x" * (16 * 1024**2)  # well over what the kernel buffers per socket
    server.add_route("/big", lambda query: (200, "text/plain", big))
    readers: list[socket.socket] = []
    try:
        for _ in range(12):  # 192 MiB asked for, none read
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", server.port))
            s.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            readers.append(s)
        wait_for(lambda: server.refused["output"] >= 4, 60, what="non-reading clients closed over the output budget")
        pending = sum(sum(len(m) for m in c.out) for c in list(server._server._conns.values()))
        assert pending <= http_serving.MAX_PENDING_OUTPUT + len(big)
        assert _get(server) == 200
    finally:
        for s in readers:
            s.close()
        server.shutdown()


def test_pipelined_requests_then_half_close_are_all_answered() -> None:
    server = _server()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 3 + b"GET /nope HTTP/1.0\r\n\r\n")
            s.shutdown(socket.SHUT_WR)  # as `nc -N` does
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        assert data.count(b"HTTP/1.1 200") == 3 and data.count(b"ok\n") == 3 and data.count(b" 404 ") == 1
    finally:
        server.shutdown()


def test_stalled_tls_handshakes_hold_no_worker_and_end_at_the_deadline(tmp_path: Path) -> None:
    key, crt = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    server = AgentHTTPServer("127.0.0.1", 0, Exposition(State().view), WebConfig(cert_file=str(crt), key_file=str(key)),
                             HttpLimits(request_deadline=5.0, workers=1))
    server.start()
    stalled = []
    try:
        for _ in range(12):  # the first bytes of a TLS record, then nothing
            stalled.append(socket.create_connection(("127.0.0.1", server.port), timeout=30))
            stalled[-1].sendall(b"\x16\x03\x01")
        wait_for(lambda: len(server._server._conns) == 12, 30, what="12 stalled handshakes held")
        ctx = ssl.create_default_context(cafile=str(crt))
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:  # one worker, and it is free
            tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert tls.recv(64).startswith(b"HTTP/1.1 200")
        for s in stalled:
            s.settimeout(30)
            assert _closed_by_server(s)
        assert server.refused["deadline"] >= 12
    finally:
        for s in stalled:
            s.close()
        server.shutdown()


SLOWLORIS = r"""
import socket, sys, time
import os
port, conns, stop = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
sources = ["127.0.0.%d" % (i % 4 + 1) for i in range(conns)]  # four client addresses
socks, opened, closed = [None] * conns, 0, 0
end = time.monotonic() + 300
while time.monotonic() < end and not os.path.exists(stop):
    for i in range(conns):
        if socks[i] is None:
            try:
                socks[i] = socket.create_connection(("127.0.0.1", port), timeout=2, source_address=(sources[i], 0))
                socks[i].sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                opened += 1
            except OSError:
                socks[i] = None
                continue
        try:  # one more header line: never a complete request
            socks[i].sendall(b"X-Slow: %d\r\n" % i)
        except OSError:
            socks[i].close()
            socks[i], closed = None, closed + 1
    time.sleep(0.5)
print(opened, closed, flush=True)
"""


@as_root_with_setpriv
def test_slowloris_from_nobody_does_not_starve_scrapes(tmp_path: Path) -> None:
    """Item 9: unprivileged clients holding 4x the connections and sending a header line
    every 0.5 s, reconnecting whenever they are closed. Every scrape is still answered
    quickly, and the agent's threads do not grow."""
    port = free_port()
    agent = AgentProcess(["attach", "--pid", str(os.getpid()), "--listen", f"127.0.0.1:{port}", "--no-stacks"], tmp_path,
                         env={"PROFAGENT_HTTP_REQUEST_DEADLINE": "2", "PROFAGENT_HTTP_MAX_CONNECTIONS": "32",
                              "PROFAGENT_HTTP_MAX_CONNECTIONS_PER_CLIENT": "6"})
    url = f"http://127.0.0.1:{port}"
    attacker, script = None, None
    try:
        agent.wait_healthy(url, timeout=60)
        threads_before = threads(agent.proc.pid)
        script = Path(tempfile.mkdtemp(prefix="profagent-sec-")) / "slowloris.py"  # pytest's tmp is 0700
        script.parent.chmod(0o755)
        script.write_text(SLOWLORIS)
        script.chmod(0o644)
        attacker = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                                     "/usr/bin/python3", str(script), str(port), "128", str(script.parent / "stop")],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # Prove the attack is on: the agent closes its connections over the caps.
        wait_for(lambda: "connections from" in agent.output or attacker.poll() is not None, 30,
                 what="the agent refusing the attacker's connections over the per-client cap")
        assert attacker.poll() is None, attacker.stderr.read() if attacker.stderr else ""
        latencies, peak_threads = [], 0
        for _ in range(30):
            start = time.monotonic()
            assert "profagent_build_info" in http_get(url + "/metrics", timeout=20)
            latencies.append(time.monotonic() - start)
            peak_threads = max(peak_threads, threads(agent.proc.pid))
            time.sleep(0.2)
        (script.parent / "stop").touch()
        out, err = attacker.communicate(timeout=120)
        assert attacker.returncode == 0, err
        opened, closed = map(int, out.split())
        assert opened > 128 and closed > 0, (opened, closed)  # it was closed and came back, over and over
        latencies.sort()
        assert latencies[len(latencies) // 2] < 1.0 and latencies[-1] < 10.0, latencies
        assert peak_threads <= threads_before + 1, (threads_before, peak_threads)
    finally:
        if attacker is not None and attacker.poll() is None:
            attacker.kill()
            attacker.wait()
        agent.stop()
        if script is not None:
            shutil.rmtree(script.parent, ignore_errors=True)


GUESSER = r"""
import base64, socket, sys, time
port, count = int(sys.argv[1]), int(sys.argv[2])
for i in range(count):
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        auth = base64.b64encode(b"u:guess%d" % i).decode()
        s.sendall(("GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic %s\r\nConnection: close\r\n\r\n" % auth).encode())
        status = s.recv(64).split()[1].decode()
    print(status, round(time.monotonic() - start, 3), flush=True)
"""


@as_root_with_setpriv
def test_failed_logins_from_nobody_never_lock_out_the_right_password() -> None:
    """Item 13: wrong passwords from 127.0.0.1 slow down that client's failures only; the
    right password from the same address is answered 200 throughout, and at once."""
    server = _server({"u": HASH}, auth_backoff_max=0.8)
    workdir = Path(tempfile.mkdtemp(prefix="profagent-sec-"))
    try:
        workdir.chmod(0o755)
        script = workdir / "guess.py"
        script.write_text(GUESSER)
        script.chmod(0o644)
        attacker = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                                     "/usr/bin/python3", str(script), str(server.port), "8"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        right = []
        while attacker.poll() is None:
            right.append(_get(server, "right"))  # same address as the attacker
        out, err = attacker.communicate(timeout=120)
        assert attacker.returncode == 0, err
        answers = [line.split() for line in out.splitlines()]
        assert [status for status, _ in answers] == ["401"] * 8  # never 429: nobody is locked out
        held = [float(seconds) for _, seconds in answers]
        assert min(held[3:]) >= 0.8  # its failures were held at the cap (a lower bound, not a deadline)
        assert len(right) >= 5 and set(right) == {200}, right
        assert _get(server, "right") == 200
    finally:
        server.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)


def test_failure_backoff_doubles_per_client_and_is_forgotten() -> None:
    now = [0.0]
    auth = http_auth.Authenticator({"u": HASH}, backoff_max=1.0, clock=lambda: now[0])
    assert [auth.failed("10.0.0.1") for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert auth.failed("10.0.0.2") == 0.1  # another client starts at the bottom
    now[0] += http_auth.AUTH_WINDOW
    assert auth.failed("10.0.0.1") == 0.1  # a quiet window forgets the failures
    for i in range(http_auth.AUTH_CLIENTS_TRACKED * 3):
        auth.failed(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}")
    assert len(auth._failures) == http_auth.AUTH_CLIENTS_TRACKED  # memory bounded under a spray
    good = "Basic " + base64.b64encode(b"u:right").decode()
    assert auth.check(good) and auth.cached(good)  # failures never refuse the right password


def test_unknown_user_costs_a_bcrypt_check_of_the_same_cost(monkeypatch) -> None:
    costs: list[bytes] = []
    real = bcrypt.checkpw

    def recording(password: bytes, hashed: bytes) -> bool:
        costs.append(hashed.split(b"$")[2])
        return real(password, hashed)

    auth = http_auth.Authenticator({"u": HASH})
    monkeypatch.setattr(http_auth.bcrypt, "checkpw", recording)
    assert not auth.check("Basic " + base64.b64encode(b"nosuchuser:x").decode())
    assert not auth.check("Basic " + base64.b64encode(b"u:wrong").decode())
    assert costs == [b"10", b"10"]


def test_unknown_and_known_users_answer_alike() -> None:
    """Answer times of a wrong password for a known user and for an unknown one, sampled
    alternately: their medians differ by far less than a bcrypt check (before: ~1 ms vs ~65 ms
    at cost 10; here cost 8)."""
    server = _server({"u": bcrypt.hashpw(b"right", bcrypt.gensalt(rounds=8))}, auth_backoff_max=0)
    try:
        times: dict[str, list[float]] = {"u": [], "nosuchuser": []}
        for i in range(20):
            for user in times:
                start = time.perf_counter()
                assert _get(server, f"wrong{i}", user=user) == 401
                times[user].append(time.perf_counter() - start)
        known, unknown = (sorted(t)[len(t) // 2] for t in times.values())
        assert 0.5 < unknown / known < 2, (known, unknown)
    finally:
        server.shutdown()


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


def test_urllib_sanity() -> None:
    """The server under test is a real HTTP server (urllib talks to it as Prometheus would)."""
    server = _server({"u": HASH})
    try:
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30)
        assert exc.value.code == 401
    finally:
        server.shutdown()

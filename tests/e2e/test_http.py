"""The HTTP endpoint over real loopback: TLS and basic auth from a web-config.yml."""

from __future__ import annotations

import base64
import os
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest

from helpers.agent import free_port
from helpers.paths import ROOT
from profagent.errors import UserError
from profagent.exporters.exposition import Exposition
from profagent.exporters.http import AgentHTTPServer, load_web_config
from profagent.state import State


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tls")
    key, crt = d / "key.pem", d / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )
    return crt, key


def _server(web_config=None) -> AgentHTTPServer:
    state = State()
    server = AgentHTTPServer("127.0.0.1", 0, Exposition(state.view), web_config)
    server.start()
    return server


def _get(url: str, ctx: ssl.SSLContext | None = None, auth: tuple[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=5, context=ctx) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_plain_http_serves_metrics_and_healthz() -> None:
    server = _server()
    try:
        base = f"http://127.0.0.1:{server.port}"
        status, body = _get(base + "/metrics")
        assert status == 200 and "profagent_build_info" in body and "process_cpu_seconds_total" in body
        assert _get(base + "/healthz") == (200, "ok\n")
        assert _get(base + "/nope")[0] == 404
    finally:
        server.shutdown()


def test_tls_and_basic_auth(tmp_path: Path, cert) -> None:
    crt, key = cert
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    cfg = tmp_path / "web.yml"
    cfg.write_text(
        f"tls_server_config:\n  cert_file: {crt}\n  key_file: {key}\n"
        f"basic_auth_users:\n  prom: '{hashed}'\n"
    )
    server = _server(load_web_config(cfg))
    try:
        url = f"https://127.0.0.1:{server.port}/metrics"
        assert server.url.startswith("https://")
        ctx = ssl.create_default_context(cafile=str(crt))
        status, body = _get(url, ctx, ("prom", "s3cret"))
        assert status == 200 and "profagent_build_info" in body
        assert _get(url, ctx, ("prom", "wrong"))[0] == 401
        assert _get(url, ctx, ("nobody", "s3cret"))[0] == 401
        assert _get(url, ctx)[0] == 401
        assert _get(url, ctx, ("prom", "s3cret"))[0] == 200  # cached check still right
        # Plain HTTP against the TLS port fails, it never serves metrics in clear text.
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=3).read()
        # An untrusted client does not get through either.
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url, timeout=3, context=ssl.create_default_context()).read()
    finally:
        server.shutdown()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tls_server_config: [1\n", "malformed web config"),
        ("basic_auth_users:\n  a: plain\n", "not a bcrypt hash"),
        ("tls_server_config:\n  cert_file: x\n", "only one of cert_file/key_file"),
        ("basic_auth: {}\n", "unknown key 'basic_auth'"),
    ],
)
def test_bad_web_config(tmp_path: Path, text: str, message: str) -> None:
    cfg = tmp_path / "web.yml"
    cfg.write_text(text)
    with pytest.raises(UserError, match=message):
        load_web_config(cfg)


def test_missing_cert_files_fail_cleanly(tmp_path: Path) -> None:
    cfg = tmp_path / "web.yml"
    cfg.write_text("tls_server_config:\n  cert_file: nope.pem\n  key_file: nope.key\n")
    state = State()
    server = AgentHTTPServer("127.0.0.1", 0, Exposition(state.view), load_web_config(cfg))
    with pytest.raises(UserError, match="cannot load TLS certificate"):
        server.start()
    server.shutdown()


def test_port_in_use() -> None:
    port = free_port()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
        s.bind(("127.0.0.1", port))
        s.listen()
        state = State()
        server = AgentHTTPServer("127.0.0.1", port, Exposition(state.view))
        with pytest.raises(UserError, match=f"port {port} on 127.0.0.1 is already in use"):
            server.start()


def test_unreadable_web_config(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        with pytest.raises(UserError, match="not found"):
            load_web_config(tmp_path / "absent.yml")
        return
    cfg = tmp_path / "web.yml"
    cfg.write_text("{}")
    cfg.chmod(0)
    with pytest.raises(UserError, match="cannot read"):
        load_web_config(cfg)


def test_exposition_is_cached_per_state_version_and_openmetrics_ends_once() -> None:
    from profagent.contracts import ProcessInfo, ProcessTree
    from profagent.exporters.exposition import Exposition

    state = State()
    tree = ProcessTree("j", 1, (ProcessInfo(1, 0, 0.0, "main", "0", "0", "1", "x", "j"),), True)
    state.set_tree(tree)
    exposition = Exposition(state.view)
    first, ctype = exposition.render("")
    assert b'profagent_target_up{job_id="j"} 1.0' in first and ctype.startswith("text/plain")
    assert exposition.render("")[0].split(b"profagent_build_info")[1] == first.split(b"profagent_build_info")[1]
    state.set_tree(ProcessTree("j", 1, (), False))  # a new version must show at once
    assert b'profagent_target_up{job_id="j"} 0.0' in exposition.render("")[0]
    om, om_type = exposition.render("application/openmetrics-text; version=1.0.0")
    assert om_type.startswith("application/openmetrics-text")
    assert om.count(b"# EOF") == 1 and om.endswith(b"# EOF\n")
    assert b"process_cpu_seconds_total" in om  # the agent's own families are there too


def test_block_cache_matches_a_full_render_and_follows_new_snapshots() -> None:
    """The per-source block cache must give exactly what a fresh exposition renders."""
    import sys

    from profagent.exporters.exposition import Exposition

    sys.path.insert(0, str(ROOT / "bench"))
    from synthetic import synthetic_state

    state, republish, _ = synthetic_state()
    exposition = Exposition(state.view)
    state.subscribe(exposition.prerender)

    def ours(text: str) -> dict:
        from helpers.agent import parse_metrics

        return {name: sorted(map(repr, rows)) for name, rows in parse_metrics(text).items()
                if name.startswith("profagent_")}

    for _ in range(3):
        full = ours(Exposition(state.view).render("")[0].decode())  # a fresh one: no cache
        cached = ours(exposition.render("")[0].decode())
        assert cached == full and len(full) > 50
        republish()  # new snapshots: the blocks must follow


def test_incidents_cli_through_basic_auth_and_tls(tmp_path: Path, cert) -> None:
    """`incidents list/show --url` reach an agent that asks for TLS and a password, with the
    flags of every --url command: --basic-auth-file, PROFAGENT_BASIC_AUTH, --ca-file, --insecure."""
    import json
    import sys
    import time

    from profagent.engine.incidents.store import IncidentStore
    from profagent.exporters.api.incidents import incidents_route

    crt, key = cert
    store = IncidentStore(tmp_path / "incidents")
    folder = store.create("hang", "job-7", time.time())
    (folder / "incident.json").write_text(json.dumps({"id": folder.name, "kind": "hang", "job_id": "job-7",
                                                      "time": time.time(), "status": "complete"}))
    (folder / "summary.md").write_text("# hang of job-7\nrank 1 waits\n")
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {crt}\n  key_file: {key}\nbasic_auth_users:\n  ops: '{hashed}'\n")
    server = _server(load_web_config(web))
    server.add_route("/api/incidents", incidents_route(store.list))
    secret = tmp_path / "auth"
    secret.write_text("ops:s3cret\n")
    url = f"https://127.0.0.1:{server.port}"
    env = {k: v for k, v in os.environ.items() if k != "PROFAGENT_BASIC_AUTH"}

    def cli(*args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "profagent", "incidents", *args], capture_output=True, text=True,
                              timeout=60, env={**env, **extra})

    def one_line_exit_2(res: subprocess.CompletedProcess, word: str) -> None:
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and word in res.stderr, res.stderr

    try:
        listed = cli("list", "--url", url, "--json", "--basic-auth-file", str(secret), "--ca-file", str(crt))
        assert listed.returncode == 0, listed.stderr
        assert [(i["id"], i["job_id"]) for i in json.loads(listed.stdout)] == [(folder.name, "job-7")]
        shown = cli("show", folder.name, "--url", url, "--insecure", PROFAGENT_BASIC_AUTH="ops:s3cret")
        assert shown.returncode == 0 and "rank 1 waits" in shown.stdout and "summary.md" in shown.stdout, shown.stderr
        one_line_exit_2(cli("list", "--url", url, "--ca-file", str(crt)), "--basic-auth")
        one_line_exit_2(cli("list", "--url", url, "--basic-auth", "ops:s3cret"), "--ca-file")  # an unknown CA
        one_line_exit_2(cli("show", "nope", "--url", url, "--basic-auth", "ops:s3cret", "--insecure"), "incidents list")
    finally:
        server.shutdown()

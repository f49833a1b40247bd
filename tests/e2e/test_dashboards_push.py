"""`profagent dashboards push` and `export`, against a local stand-in for Grafana's HTTP API
(helpers/grafana.FakeGrafana: what push calls, with Grafana's status codes, every request
recorded so the tests can check the payloads and the auth header)."""

from __future__ import annotations

import base64
import json
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from helpers.agent import free_port
from helpers.grafana import FakeGrafana
from helpers.paths import ROOT
from profagent.errors import UserError
from profagent.exporters.grafana.publish import export, folder_uid, parse_credential, push

DASHBOARDS = ROOT / "dashboards"
UIDS = {"profagent-overview", "profagent-gpus", "profagent-stacks", "profagent-traces", "profagent-agent",
        "profagent-cluster"}


@pytest.fixture
def grafana() -> Iterator[FakeGrafana]:
    fake = FakeGrafana()
    yield fake
    fake.stop()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profagent", "dashboards", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "GRAFANA_TOKEN": ""})


def _one_line_error(res: subprocess.CompletedProcess, fragment: str) -> None:
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert fragment in lines[0], lines[0]


def test_push_creates_the_folder_and_saves_every_dashboard(grafana: FakeGrafana) -> None:
    pushed = push(grafana.url, "s3cret")
    assert {p.uid for p in pushed} == UIDS
    assert grafana.folders == {"profagent": "profagent"}
    (create,) = grafana.calls("POST", "/api/folders")
    assert create[3] == {"title": "profagent", "uid": "profagent"}
    saves = grafana.calls("POST", "/api/dashboards/db")
    assert len(saves) == len(UIDS)
    for _, _, headers, body in saves:
        assert headers["Authorization"] == "Bearer s3cret"
        assert isinstance(body, dict)
        assert body["folderUid"] == "profagent" and body["overwrite"] is True
        model = body["dashboard"]
        assert model["id"] is None
        committed = json.loads((DASHBOARDS / f"{model['uid']}.json").read_text())
        assert {**model, "id": None} == {**committed, "id": None}
    assert all(p.url == f"{grafana.url}/d/{p.uid}/slug" for p in pushed)


def test_push_twice_is_idempotent(grafana: FakeGrafana) -> None:
    push(grafana.url, "s3cret")
    push(grafana.url, "s3cret")
    assert len(grafana.calls("POST", "/api/folders")) == 1
    assert grafana.folders == {"profagent": "profagent"}
    assert set(grafana.dashboards) == UIDS
    assert {d["version"] for d in grafana.dashboards.values()} == {2}


def test_push_reuses_a_folder_found_by_title(grafana: FakeGrafana) -> None:
    grafana.folders["abc123"] = "ML team"
    push(grafana.url, ("admin", "pw"), folder="ML team")
    assert grafana.calls("POST", "/api/folders") == []
    assert {d["folderUid"] for d in grafana.dashboards.values()} == {"abc123"}
    basic = "Basic " + base64.b64encode(b"admin:pw").decode()
    assert all(r[2]["Authorization"] == basic for r in grafana.requests)


def test_push_cli_with_basic_auth_and_a_new_folder(grafana: FakeGrafana) -> None:
    res = _cli("push", "--url", grafana.url + "/", "--basic-auth", "admin:pw", "--folder", "Team A / GPUs")
    assert res.returncode == 0, res.stderr
    assert grafana.folders == {"team-a-gpus": "Team A / GPUs"}
    assert len(res.stdout.splitlines()) == len(UIDS) and "profagent / Job overview: http" in res.stdout


def test_push_cli_auth_failure_is_one_line(grafana: FakeGrafana) -> None:
    _one_line_error(_cli("push", "--url", grafana.url, "--token", "wrong"), "rejected the credentials (401)")
    assert grafana.dashboards == {}


def test_push_cli_unreachable_url_is_one_line() -> None:
    _one_line_error(_cli("push", "--url", f"http://127.0.0.1:{free_port()}", "--token", "t"),
                    "cannot reach Grafana")


def test_push_forbidden_names_the_role(grafana: FakeGrafana) -> None:
    grafana.forbid_writes = True
    with pytest.raises(UserError, match="refused to save dashboards .403.*Editor"):
        push(grafana.url, "s3cret")


def test_push_cli_needs_exactly_one_credential() -> None:
    _one_line_error(_cli("push", "--url", "http://127.0.0.1:1"), "exactly one of --token and --basic-auth")
    _one_line_error(_cli("push", "--url", "http://127.0.0.1:1", "--token", "t", "--basic-auth", "a:b"), "exactly one")


def test_parse_credential_and_folder_uid() -> None:
    assert parse_credential("tok", None) == "tok"
    assert parse_credential(None, "user:pa:ss") == ("user", "pa:ss")
    with pytest.raises(UserError, match="USER:PASS"):
        parse_credential(None, "nopassword")
    assert folder_uid("profagent") == "profagent"
    assert folder_uid("Team A / GPUs") == "team-a-gpus"
    assert len(folder_uid("x" * 100)) == 40


def test_export_writes_provisioning_ready_files(tmp_path: Path) -> None:
    written = export(tmp_path / "out")
    names = {str(p.relative_to(tmp_path / "out")) for p in written}
    assert names == {f"{uid}.json" for uid in UIDS} | {
        "provisioning/datasources/profagent.yaml", "provisioning/dashboards/profagent.yaml"}
    for uid in UIDS:
        assert (tmp_path / "out" / f"{uid}.json").read_text() == (DASHBOARDS / f"{uid}.json").read_text()
    provider = yaml.safe_load((tmp_path / "out" / "provisioning/dashboards/profagent.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == str((tmp_path / "out").resolve())
    assert (tmp_path / "out" / "provisioning/datasources/profagent.yaml").read_text() == (
        DASHBOARDS / "provisioning/datasources/profagent.yaml").read_text()


def test_export_cli(tmp_path: Path) -> None:
    res = _cli("export", str(tmp_path), "--grafana-path", "/srv/dash")
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.splitlines()) == len(UIDS) + 2  # and the two provisioning files
    provider = yaml.safe_load((tmp_path / "provisioning/dashboards/profagent.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/srv/dash"


def test_export_to_an_unwritable_place_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _one_line_error(_cli("export", str(blocker / "sub")), "cannot write to")


def test_export_and_push_do_not_need_the_sdk(tmp_path: Path) -> None:
    """grafana-foundation-sdk is a test extra: the installed CLI must work without it."""
    code = (
        "import sys; sys.modules['grafana_foundation_sdk'] = None\n"  # any import of it now fails
        "sys.argv = ['profagent', 'dashboards', 'export', sys.argv[1]]\n"
        "from profagent.cli import main; main()\n"
    )
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert len(list(tmp_path.glob("*.json"))) == len(UIDS)


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tls")
    key, crt = d / "key.pem", d / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )
    return crt, key


@pytest.fixture
def tls_grafana(cert: tuple[Path, Path]) -> Iterator[FakeGrafana]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*cert)
    fake = FakeGrafana(context=context)
    yield fake
    fake.stop()


def test_push_over_tls_verifies_the_certificate(tls_grafana: FakeGrafana, cert: tuple[Path, Path]) -> None:
    # a self-signed certificate is refused, in one line that names both ways out
    _one_line_error(_cli("push", "--url", tls_grafana.url, "--token", "s3cret"), "cannot verify Grafana's certificate")
    assert tls_grafana.requests == []  # nothing (no token) was sent before the certificate was checked
    res = _cli("push", "--url", tls_grafana.url, "--token", "s3cret", "--ca-file", str(cert[0]))
    assert res.returncode == 0, res.stderr
    assert set(tls_grafana.dashboards) == UIDS
    # skipping the check: --insecure, or ?verify=false in the URL as grafana-client read it
    assert len(push(tls_grafana.url, "s3cret", insecure=True)) == len(UIDS)
    assert len(push(tls_grafana.url + "/?verify=false", "s3cret")) == len(UIDS)
    assert {d["version"] for d in tls_grafana.dashboards.values()} == {3}
    _one_line_error(_cli("push", "--url", tls_grafana.url, "--token", "t", "--ca-file", "/nonexistent.pem"),
                    "cannot read the CA file")


def test_push_to_a_grafana_under_a_sub_path() -> None:
    fake = FakeGrafana(prefix="/grafana")
    try:
        pushed = push(fake.url + "/", "s3cret")
    finally:
        fake.stop()
    assert set(fake.dashboards) == UIDS
    assert all(r[1].startswith("/grafana/api/") for r in fake.requests)
    assert all(p.url == f"{fake.url}/d/{p.uid}/slug" for p in pushed)


def test_push_never_sends_the_credential_along_a_redirect(grafana: FakeGrafana) -> None:
    """A Grafana URL that redirects elsewhere (another host, say) does not get the token."""
    bouncer = FakeGrafana(redirect_to=grafana.url)
    try:
        with pytest.raises(UserError, match=r"rejected the credentials \(401\)"):
            push(bouncer.url, "s3cret")
    finally:
        bouncer.stop()
    assert bouncer.requests and all(r[2].get("Authorization") == "Bearer s3cret" for r in bouncer.requests)
    assert grafana.requests and all("Authorization" not in r[2] for r in grafana.requests)


def test_push_errors_are_one_line_each(grafana: FakeGrafana) -> None:
    # a server that accepts the connection and never answers
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        _one_line_error(_cli("push", "--url", url, "--token", "t", "--timeout", "1"), "did not answer in time")
    # Grafana's own message, cleaned to one printable line
    grafana.route = lambda method, path, body: (500, {"message": "database is locked\n\x1b[31mretry\x1b[0m"})
    with pytest.raises(UserError) as err:
        push(grafana.url, "s3cret")
    assert str(err.value.problem) == f"Grafana at {grafana.url} answered: HTTP 500: database is locked [31mretry [0m"
    # not Grafana at all: an HTML page
    grafana.route = lambda method, path, body: (200, b"<html><body>Welcome to nginx!</body></html>")
    with pytest.raises(UserError, match="did not answer JSON"):
        push(grafana.url, "s3cret")
    _one_line_error(_cli("push", "--url", "http://no-such-host.invalid", "--token", "t"),
                    "cannot reach Grafana at http://no-such-host.invalid (cannot resolve the host name)")

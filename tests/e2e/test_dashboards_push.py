"""`profagent dashboards push` and `export`, against a local stand-in for Grafana's HTTP API.

The stand-in implements only what push calls (GET /api/folders/UID, GET /api/folders,
POST /api/folders, POST /api/dashboards/db) with Grafana's status codes, and records
every request so the tests can check the payloads and the auth header.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from helpers.agent import free_port
from helpers.paths import ROOT
from profagent.errors import UserError
from profagent.exporters.grafana.publish import export, folder_uid, parse_credential, push

DASHBOARDS = ROOT / "dashboards"
UIDS = {"profagent-overview", "profagent-gpus", "profagent-stacks", "profagent-traces", "profagent-agent",
        "profagent-cluster"}


class FakeGrafana:
    def __init__(self, token: str = "s3cret", basic: tuple[str, str] = ("admin", "pw")) -> None:
        self.token = token
        self.basic = basic
        self.forbid_writes = False
        self.folders: dict[str, str] = {}  # uid -> title
        self.dashboards: dict[str, dict] = {}  # uid -> {"model", "folderUid", "version"}
        self.requests: list[tuple[str, str, dict[str, str], object]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                fake.requests.append((method, self.path, dict(self.headers), body))
                if not fake.authorized(self.headers.get("Authorization", "")):
                    return self._send(401, {"message": "Unauthorized"})
                status, answer = fake.route(method, self.path.split("?")[0], body)
                self._send(status, answer)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def authorized(self, header: str) -> bool:
        if header == f"Bearer {self.token}":
            return True
        user, password = self.basic
        return header == "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    def route(self, method: str, path: str, body: object) -> tuple[int, object]:
        if method == "GET" and path.startswith("/api/folders/"):
            uid = path.rsplit("/", 1)[1]
            if uid in self.folders:
                return 200, {"uid": uid, "title": self.folders[uid], "id": 1}
            return 404, {"message": "folder not found", "status": "not-found"}
        if method == "GET" and path == "/api/folders":
            return 200, [{"uid": uid, "title": title, "id": 1} for uid, title in self.folders.items()]
        if method == "POST" and path == "/api/folders":
            assert isinstance(body, dict)
            uid = body.get("uid") or "generated"
            if uid in self.folders:
                return 409, {"message": "a folder with the same uid already exists"}
            self.folders[uid] = body["title"]
            return 200, {"uid": uid, "title": body["title"], "id": 2}
        if method == "POST" and path == "/api/dashboards/db":
            if self.forbid_writes:
                return 403, {"message": "Access denied"}
            assert isinstance(body, dict)
            model = body["dashboard"]
            uid = model["uid"]
            if body.get("folderUid") not in self.folders:
                return 400, {"message": "folder not found"}
            old = self.dashboards.get(uid)
            if old is not None and not body.get("overwrite"):
                return 412, {"message": "A dashboard with the same uid already exists", "status": "name-exists"}
            version = (old["version"] + 1) if old else 1
            self.dashboards[uid] = {"model": model, "folderUid": body["folderUid"], "version": version}
            return 200, {"id": 10, "uid": uid, "url": f"/d/{uid}/slug", "status": "success", "version": version}
        return 404, {"message": "not found"}

    def calls(self, method: str, prefix: str) -> list[tuple[str, str, dict[str, str], object]]:
        return [r for r in self.requests if r[0] == method and r[1].startswith(prefix)]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


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

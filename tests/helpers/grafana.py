"""A local stand-in for Grafana's HTTP API (what ``profagent dashboards push`` calls).

It implements only GET /api/folders/UID, GET /api/folders, POST /api/folders and
POST /api/dashboards/db, with Grafana's status codes, and records every request so the
tests can check the payloads and the auth header. Optional: TLS (an ``ssl`` server
context), a sub-path (Grafana served under ``/grafana``), and answering every request
with a redirect elsewhere.
"""

from __future__ import annotations

import base64
import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeGrafana:
    def __init__(self, token: str = "s3cret", basic: tuple[str, str] = ("admin", "pw"), prefix: str = "",
                 context: ssl.SSLContext | None = None, redirect_to: str | None = None) -> None:
        self.token = token
        self.basic = basic
        self.prefix = prefix  # e.g. "/grafana": Grafana behind a reverse proxy's sub-path
        self.redirect_to = redirect_to  # answer 307 to this URL + the path, to everything
        self.forbid_writes = False
        self.folders: dict[str, str] = {}  # uid -> title
        self.dashboards: dict[str, dict] = {}  # uid -> {"model", "folderUid", "version"}
        self.requests: list[tuple[str, str, dict[str, str], object]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: object) -> None:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()  # bytes: not JSON
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                fake.requests.append((method, self.path, dict(self.headers), body))
                if fake.redirect_to is not None:
                    self.send_response(307)
                    self.send_header("Location", fake.redirect_to + self.path)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                if not fake.authorized(self.headers.get("Authorization", "")):
                    return self._send(401, {"message": "Unauthorized"})
                path = self.path.split("?")[0]
                if not path.startswith(fake.prefix + "/"):
                    return self._send(404, {"message": "not found"})
                status, answer = fake.route(method, path[len(fake.prefix):], body)
                self._send(status, answer)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if context is not None:
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        scheme = "https" if context is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}{prefix}"
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
            return 200, {"id": 10, "uid": uid, "url": f"{self.prefix}/d/{uid}/slug", "status": "success", "version": version}
        return 404, {"message": "not found"}

    def calls(self, method: str, prefix: str) -> list[tuple[str, str, dict[str, str], object]]:
        return [r for r in self.requests if r[0] == method and r[1].startswith(prefix)]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

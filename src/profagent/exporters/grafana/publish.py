"""``profagent dashboards export`` and ``push``: the committed dashboards, out to a user.

Both read the JSON files committed under ``dashboards/`` (shipped in the wheel, found
with ``asset_dir("dashboards")``), so the installed package needs neither the SDK that
generated them nor a checkout. ``push`` makes four kinds of calls to Grafana's HTTP API
with the standard library (``urllib.request``): it finds or creates the folder, then saves
every dashboard with ``overwrite`` by uid, so pushing twice leaves Grafana as pushing once.
No HTTP client dependency: grafana-client pulled in niquests and urllib3-future, whose
``.pth`` file replaces the user's urllib3 at every interpreter start (issue 23).
"""

from __future__ import annotations

import base64
import json
import re
import socket
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urljoin, urlsplit

from profagent import __version__
from profagent.assets import asset_dir
from profagent.errors import UserError
from profagent.exporters.grafana.provisioning import (
    DATASOURCE_FILE,
    FOLDER,
    PROVIDER_FILE,
    datasource_yaml,
    provider_yaml,
)


def committed_dashboards(root: Path | None = None) -> dict[str, dict]:
    """File name -> dashboard model of every committed dashboard.

    Raises UserError when the folder is missing or a file is not valid JSON.
    """
    try:
        folder = root if root is not None else asset_dir("dashboards")
    except FileNotFoundError as exc:
        raise UserError("profagent's dashboards are not installed", "reinstall profagent") from exc
    out: dict[str, dict] = {}
    for path in sorted(folder.glob("*.json")):
        try:
            out[path.name] = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read dashboard {path}: {exc}", "reinstall profagent") from exc
    if not out:
        raise UserError(f"no dashboards in {folder}", "reinstall profagent")
    return out


def export(dest: Path, grafana_path: str | None = None, root: Path | None = None) -> list[Path]:
    """Write the dashboards and the provisioning files under ``dest``.

    ``grafana_path`` is where Grafana will read the JSON files (the provider's path);
    by default ``dest`` itself, so a Grafana on this machine can use ``dest/provisioning``
    as it is. Raises UserError when ``dest`` cannot be written.
    """
    boards = committed_dashboards(root)
    path_in_grafana = grafana_path or str(dest.resolve())
    files = {name: json.dumps(model, indent=2, sort_keys=True, ensure_ascii=False) + "\n" for name, model in boards.items()}
    files[DATASOURCE_FILE] = datasource_yaml()
    files[PROVIDER_FILE] = provider_yaml(path_in_grafana)
    written = []
    try:
        for rel, text in files.items():
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
            written.append(target)
    except OSError as exc:
        raise UserError(f"cannot write to {dest}: {exc.strerror or exc}", "choose a folder you can write to") from exc
    return written


# -- push ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pushed:
    title: str
    uid: str
    url: str


def parse_credential(token: str | None, basic_auth: str | None) -> str | tuple[str, str]:
    """The credential: a token, or (user, password) from ``USER:PASS``.

    Raises UserError unless exactly one is given and ``USER:PASS`` has both parts.
    """
    if bool(token) == bool(basic_auth):
        raise UserError("give exactly one of --token and --basic-auth", "e.g. --token $GRAFANA_TOKEN or --basic-auth admin:admin")
    if token:
        return token
    user, sep, password = (basic_auth or "").partition(":")
    if not sep or not user:
        raise UserError("--basic-auth must be USER:PASS", "e.g. --basic-auth admin:admin")
    return (user, password)


def folder_uid(name: str) -> str:
    """A stable Grafana uid for a folder name (letters, digits, - and _; 40 at most)."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-").lower()
    return (slug or FOLDER)[:40]


MAX_ANSWER = 16 << 20  # bytes read from one Grafana answer


class GrafanaError(Exception):
    """Grafana answered an HTTP error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class GrafanaAPI:
    """The calls ``push`` makes to Grafana's HTTP API, over the standard library.

    ``base`` is Grafana's root URL (a sub-path such as ``https://host/grafana`` included).
    The credential goes in every request, as Grafana expects, but never follows a redirect
    (``add_unredirected_header``): a redirect to another host does not get it. Proxies
    come from the usual ``https_proxy``/``no_proxy`` variables, as with any HTTP client.
    """

    def __init__(self, base: str, credential: str | tuple[str, str], timeout: float,
                 context: ssl.SSLContext | None = None) -> None:
        self.base = base
        self.timeout = timeout
        if isinstance(credential, tuple):
            pair = f"{credential[0]}:{credential[1]}".encode()
            self._authorization = "Basic " + base64.b64encode(pair).decode("ascii")
        else:
            self._authorization = f"Bearer {credential}"
        self._opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context))

    def call(self, method: str, path: str, body: object = None) -> Any:
        """``method`` ``/api{path}`` with a JSON body; the decoded JSON answer (None if empty).
        Raises GrafanaError for an HTTP error status, OSError (URLError, TimeoutError,
        ssl errors) when Grafana cannot be reached, ValueError for an answer that is not JSON."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + "/api" + path, data=data, method=method, headers={
            "Accept": "application/json", "User-Agent": f"profagent/{__version__}"})
        if data is not None:
            request.add_header("Content-Type", "application/json")
        request.add_unredirected_header("Authorization", self._authorization)
        try:
            with self._opener.open(request, timeout=self.timeout) as answer:
                raw = answer.read(MAX_ANSWER)
        except urllib.error.HTTPError as exc:
            raise GrafanaError(exc.code, _message(exc.read(MAX_ANSWER))) from None
        return json.loads(raw) if raw.strip() else None

    def ensure_folder(self, name: str) -> str:
        """The uid of the folder titled ``name``, created if there is none."""
        uid = folder_uid(name)
        try:
            found = self.call("GET", f"/folders/{uid}")
            return str(found.get("uid", uid)) if isinstance(found, dict) else uid
        except GrafanaError as exc:
            if exc.status != 404:
                raise
        for folder in self.call("GET", "/folders") or []:
            if isinstance(folder, dict) and folder.get("title") == name and folder.get("uid"):
                return str(folder["uid"])
        created = self.call("POST", "/folders", {"title": name, "uid": uid})
        return str(created.get("uid", uid)) if isinstance(created, dict) else uid

    def save_dashboard(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /api/dashboards/db: Grafana's answer (its ``url`` is the dashboard's path)."""
        result = self.call("POST", "/dashboards/db", body)
        return result if isinstance(result, dict) else {}


def _message(raw: bytes) -> str:
    """Grafana's ``message`` from an error answer (else its text), on one printable line."""
    text = raw.decode("utf-8", errors="replace")
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if isinstance(answer, dict) and "message" in answer:
        text = str(answer["message"])
    text = "".join(c if c.isprintable() else " " for c in text)
    return " ".join(text.split())[:200] or "no message"


def _explain(exc: Exception, url: str) -> UserError:
    """One line for whatever went wrong talking to Grafana."""
    if isinstance(exc, GrafanaError):
        if exc.status == 401:
            return UserError(f"Grafana at {url} rejected the credentials (401)", "check --token or --basic-auth")
        if exc.status == 403:
            return UserError(
                f"Grafana at {url} refused to save dashboards (403)",
                "use a token or user with the Editor or Admin role",
            )
        return UserError(f"Grafana at {url} answered: {exc}", "check --url points at Grafana's root URL")
    if _timed_out(exc):
        return UserError(f"Grafana at {url} did not answer in time", "check --url and that Grafana is running")
    if isinstance(exc, ValueError):
        return UserError(f"Grafana at {url} did not answer JSON", "check --url points at Grafana's root URL")
    cert = _certificate_error(exc)
    if cert is not None:
        return UserError(f"cannot verify Grafana's certificate at {url} ({cert})",
                         "pass the CA that signed it with --ca-file, or --insecure to skip the check")
    return UserError(f"cannot reach Grafana at {url} ({_root_cause(exc)})", "check --url and that Grafana is running")


def _timed_out(exc: BaseException) -> bool:
    reason = getattr(exc, "reason", None)  # urllib wraps a connect timeout in a URLError
    return isinstance(exc, TimeoutError) or isinstance(reason, TimeoutError)


def _certificate_error(exc: BaseException) -> str | None:
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, ssl.SSLCertVerificationError):
        return reason.verify_message or "certificate verify failed"
    return None


def _root_cause(exc: BaseException) -> str:
    """The innermost OS-level reason ("Connection refused", "Name or service not known")."""
    reason = type(exc).__name__
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            break
        inner = getattr(seen, "reason", None)  # urllib's URLError holds the OSError here
        if isinstance(inner, BaseException):
            seen = inner
        if isinstance(seen, socket.gaierror):
            reason = "cannot resolve the host name"
        elif isinstance(seen, OSError) and seen.strerror:
            reason = seen.strerror
        elif isinstance(seen, ssl.SSLError):
            reason = seen.reason or str(seen)
        seen = seen.__cause__ or seen.__context__
    return reason


def grafana_root(url: str) -> tuple[str, bool]:
    """Grafana's root URL from ``--url`` (no credentials, query or trailing slash) and whether
    to verify TLS: ``?verify=false`` turns it off, as grafana-client read it. Raises UserError
    for a URL that is not http(s)."""
    if not re.match(r"^https?://[^/\s]+", url):
        raise UserError(f"--url {url!r} is not an http(s) URL", "e.g. --url http://grafana:3000")
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]  # credentials go in --token or --basic-auth
    verify = parse_qs(parts.query).get("verify", ["true"])[0].strip().lower() not in ("false", "0", "no", "off")
    return f"{parts.scheme}://{netloc}{parts.path.rstrip('/')}", verify


def tls_context(ca_file: Path | None = None, verify: bool = True) -> ssl.SSLContext:
    """The system's CAs (or ``ca_file``'s); no verification at all when ``verify`` is False.
    Raises UserError for a CA file that cannot be read."""
    try:
        context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    except (OSError, ssl.SSLError) as exc:
        raise UserError(f"cannot read the CA file {ca_file} ({_root_cause(exc)})",
                        "give a PEM file with --ca-file") from None
    if not verify:
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context


def push(
    url: str,
    credential: str | tuple[str, str],
    folder: str = FOLDER,
    timeout: float = 10.0,
    root: Path | None = None,
    ca_file: Path | None = None,
    insecure: bool = False,
) -> list[Pushed]:
    """Create the folder if needed and save every dashboard into it, overwriting by uid.

    Raises UserError (one line) on bad credentials, an unreachable URL or any refusal.
    """
    base, verify = grafana_root(url)
    boards = committed_dashboards(root)
    api = GrafanaAPI(base, credential, timeout, tls_context(ca_file, verify and not insecure))
    try:
        uid = api.ensure_folder(folder)
        pushed = []
        for model in boards.values():
            body = {
                "dashboard": {**model, "id": None},
                "folderUid": uid,
                "overwrite": True,
                "message": f"profagent {__version__} dashboards push",
            }
            path = api.save_dashboard(body).get("url") or f"/d/{model['uid']}"
            pushed.append(Pushed(model.get("title", model["uid"]), model["uid"], urljoin(base + "/", str(path))))
    except UserError:
        raise
    except Exception as exc:  # HTTP statuses, network and TLS errors become one line
        raise _explain(exc, base) from exc
    return pushed

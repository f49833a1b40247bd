"""``profagent dashboards export`` and ``push``: the committed dashboards, out to a user.

Both read the JSON files committed under ``dashboards/`` (shipped in the wheel, found
with ``asset_dir("dashboards")``), so the installed package needs neither the SDK that
generated them nor a checkout. ``push`` talks to Grafana's HTTP API through
``grafana-client``: it finds or creates the folder, then saves every dashboard with
``overwrite`` by uid, so pushing twice leaves Grafana as pushing once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

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
    """The grafana-client credential: a token, or (user, password) from ``USER:PASS``.

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


def _default_api(url: str, credential: str | tuple[str, str], timeout: float) -> Any:
    from grafana_client import GrafanaApi

    return GrafanaApi.from_url(url, credential=credential, timeout=timeout)


def _explain(exc: Exception, url: str) -> UserError:
    """One line for whatever went wrong talking to Grafana."""
    from grafana_client.client import (
        GrafanaException,
        GrafanaTimeoutError,
        GrafanaUnauthorizedError,
    )

    if isinstance(exc, GrafanaUnauthorizedError):
        return UserError(f"Grafana at {url} rejected the credentials (401)", "check --token or --basic-auth")
    if isinstance(exc, GrafanaTimeoutError):
        return UserError(f"Grafana at {url} did not answer in time", "check --url and that Grafana is running")
    if isinstance(exc, GrafanaException):
        if exc.status_code == 403:
            return UserError(
                f"Grafana at {url} refused to save dashboards (403)",
                "use a token or user with the Editor or Admin role",
            )
        message = " ".join(str(exc.message).split())[:200]
        return UserError(f"Grafana at {url} answered: {message}", "check --url points at Grafana's root URL")
    return UserError(f"cannot reach Grafana at {url} ({_root_cause(exc)})", "check --url and that Grafana is running")


def _root_cause(exc: BaseException) -> str:
    """The innermost OS-level reason ("Connection refused", "Name or service not known")."""
    import socket

    reason = type(exc).__name__
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            break
        if isinstance(seen, socket.gaierror):
            reason = "cannot resolve the host name"
        elif isinstance(seen, OSError) and seen.strerror:
            reason = seen.strerror
        seen = seen.__cause__ or seen.__context__
    return reason


def _ensure_folder(api: Any, name: str) -> str:
    """The uid of the folder titled ``name``, created if there is none."""
    from grafana_client.client import GrafanaClientError

    uid = folder_uid(name)
    try:
        found = api.folder.get_folder(uid)
        return str(found.get("uid", uid))
    except GrafanaClientError as exc:
        if exc.status_code != 404:
            raise
    for folder in api.folder.get_all_folders() or []:
        if folder.get("title") == name:
            return str(folder["uid"])
    created = api.folder.create_folder(name, uid=uid)
    return str(created.get("uid", uid))


def push(
    url: str,
    credential: str | tuple[str, str],
    folder: str = FOLDER,
    timeout: float = 10.0,
    root: Path | None = None,
    api_factory: Callable[[str, str | tuple[str, str], float], Any] = _default_api,
) -> list[Pushed]:
    """Create the folder if needed and save every dashboard into it, overwriting by uid.

    Raises UserError (one line) on bad credentials, an unreachable URL or any refusal.
    """
    if not re.match(r"^https?://[^/\s]+", url):
        raise UserError(f"--url {url!r} is not an http(s) URL", "e.g. --url http://grafana:3000")
    boards = committed_dashboards(root)
    base = url.rstrip("/")
    try:
        api = api_factory(base, credential, timeout)
        uid = _ensure_folder(api, folder)
        pushed = []
        for model in boards.values():
            body = {
                "dashboard": {**model, "id": None},
                "folderUid": uid,
                "overwrite": True,
                "message": f"profagent {__version__} dashboards push",
            }
            result = api.dashboard.update_dashboard(body) or {}
            path = result.get("url") or f"/d/{model['uid']}"
            pushed.append(Pushed(model.get("title", model["uid"]), model["uid"], urljoin(base + "/", path)))
    except UserError:
        raise
    except Exception as exc:  # grafana-client and niquests errors become one line
        raise _explain(exc, base) from exc
    return pushed

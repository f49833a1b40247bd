"""`profagent incidents`: list, show and capture incident bundles.

``list`` and ``show`` read the incidents folder directly (as the agent's user, usually
root) or ask a running agent over HTTP (``--url``); ``capture`` asks the local agent
over its control socket.
"""

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from profagent.cli.client import BasicAuthFileOpt, BasicAuthOpt, CaFileOpt, InsecureOpt
from profagent.errors import UserError

if TYPE_CHECKING:
    from profagent.cli.client import ClientAuth
    from profagent.engine.incidents.store import IncidentStore

incidents_app = typer.Typer(help="Incident bundles: evidence captured on every rank when a job hangs or slows down.",
                            no_args_is_help=True, rich_markup_mode=None)  # plain help, as the main app

ConfigOpt = Annotated[Path | None, typer.Option("--config", help="TOML config file (for incidents.dir, agent.state_dir)")]
UrlOpt = Annotated[str | None, typer.Option("--url", help="ask a running agent instead, e.g. http://127.0.0.1:19400")]
DirOpt = Annotated[Path | None, typer.Option("--dir", help="the incidents folder [default: incidents.dir, else STATE_DIR/incidents]")]


# The engine, rich, the config loader and the HTTP client's urllib are imported inside the commands: `profagent --help` and the other
# commands must not pay for them at start-up.


def _store(config: Path | None, folder: Path | None) -> "IncidentStore":
    from profagent.config import load_config
    from profagent.engine.incidents.store import IncidentStore, incidents_dir

    cfg = load_config(config, os.environ, {})
    root = folder or incidents_dir(cfg.incidents, cfg.agent.state_dir)
    if not root.is_dir():
        raise UserError(f"no incidents folder at {root}", "no incident was captured yet, or pass --dir / --url")
    if not os.access(root, os.R_OK | os.X_OK):
        raise UserError(f"cannot read {root}", "run as the agent's user (root for the service), or use --url")
    return IncidentStore(root)


def _get(url: str, auth: "ClientAuth", query: dict[str, str] | None = None) -> Any:
    from profagent.cli.client import JsonClient

    client = JsonClient(url, auth, reach_fix="check --url and that the agent runs")
    return client.get_json("/api/incidents", query, not_found=(
        f"{client.url('/api/incidents', query)} answered 404", "check the id with `profagent incidents list --url URL`"))


def _listed(body: Any) -> list[dict[str, Any]]:
    """The incidents of a GET /api/incidents answer: ``{"incidents": [...]}``, or the bare
    list that agents before 0.2 answered."""
    items = body.get("incidents") if isinstance(body, dict) else body
    if not isinstance(items, list) or not all(isinstance(m, dict) and "id" in m for m in items):
        raise UserError("the agent's /api/incidents answer is not a list of incidents", "check --url")
    return items


def _when(t: Any) -> str:
    """A listed incident's time (absent, or not a number from another agent: the epoch)."""
    seconds = float(t) if isinstance(t, int | float) and not isinstance(t, bool) else 0.0
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


@incidents_app.command("list")
def list_cmd(url: UrlOpt = None, folder: DirOpt = None, config: ConfigOpt = None,
             json_out: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
             basic_auth: BasicAuthOpt = None, basic_auth_file: BasicAuthFileOpt = None, ca_file: CaFileOpt = None,
             insecure: InsecureOpt = False) -> None:
    """List captured incidents, oldest first."""
    from rich.console import Console

    from profagent.cli.client import client_auth
    from profagent.labels import printable_data

    auth = client_auth(basic_auth, basic_auth_file, ca_file, insecure)
    items = _listed(_get(url, auth)) if url else [m.listed() for m in _store(config, folder).list()]
    out = Console()
    items = printable_data(items)  # job ids, ranks, reasons and paths come from the jobs
    if json_out:
        from profagent.engine.incidents.bundle import LISTED

        out.print_json(json.dumps([{k: m.get(k) for k in LISTED} for m in items]))
        return
    if not items:
        out.print("no incidents")
        return
    # Plain aligned lines: ids must stay whole (copy-pasted into `show`) whatever the width.
    rows = [("ID", "KIND", "JOB", "RANK", "TIME", "STATUS", "PATH")] + [
        (str(m["id"]), str(m.get("kind") or ""), str(m.get("job_id") or ""), str(m.get("rank") or "-"),
         _when(m.get("time")), str(m.get("status") or ""), str(m.get("path") or "")) for m in items]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        out.print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1],
                  markup=False, highlight=False, soft_wrap=True)


@incidents_app.command("show")
def show_cmd(incident_id: Annotated[str, typer.Argument(metavar="ID", help="the id printed by `profagent incidents list`")],
             url: UrlOpt = None, folder: DirOpt = None, config: ConfigOpt = None,
             basic_auth: BasicAuthOpt = None, basic_auth_file: BasicAuthFileOpt = None, ca_file: CaFileOpt = None,
             insecure: InsecureOpt = False) -> None:
    """Print an incident's summary, then where its files are."""
    from rich.console import Console

    from profagent.cli.client import client_auth

    auth = client_auth(basic_auth, basic_auth_file, ca_file, insecure)
    if url:
        detail = _get(url, auth, {"id": incident_id})
    else:
        from profagent.engine.incidents.store import find_incident

        meta = find_incident(_store(config, folder), incident_id)
        detail = {**meta.listed(), **meta.detail()}
    from profagent.labels import printable, printable_data

    out = Console()
    summary = detail.get("summary")
    detail = printable_data(detail)  # names in it come from the watched jobs
    if isinstance(summary, str) and summary:  # the agent's own lines: their breaks are kept
        summary = printable(summary, keep_newlines=True)
    out.print(summary or f"(no summary yet: status {detail.get('status')})", markup=False, highlight=False)
    out.print(f"files in {detail['path']}:", markup=False, highlight=False, soft_wrap=True)
    for f in detail.get("files", []):
        out.print(f"  {f['name']} ({f['bytes']} bytes)", markup=False, highlight=False)
    if any(f.get("name") == "timeline.json" for f in detail.get("files", [])):
        out.print(f"every rank's steps before the trigger: {detail['path']}/timeline.json; open it at "
                  "https://ui.perfetto.dev (Open trace file) or in chrome://tracing", markup=False, highlight=False,
                  soft_wrap=True)


@incidents_app.command("capture", short_help="Capture an incident of a running job now, through the local agent.")
def capture_cmd(
    job: Annotated[str | None, typer.Option("--job", help="the job_id (needed when the agent watches several jobs)")] = None,
    reason: Annotated[str, typer.Option("--reason", help="why, written into the summary")] = "",
    wait: Annotated[float, typer.Option("--wait", help="seconds to wait for the capture to finish (0 = do not wait)")] = 90.0,
    config: ConfigOpt = None,
) -> None:
    """Capture an incident of a running job now (asks the local agent over its control socket)."""
    from rich.console import Console

    from profagent.config import load_config
    from profagent.system.unixsock import call, default_control_socket

    cfg = load_config(config, os.environ, {})
    path = cfg.ondemand.control_socket or default_control_socket()
    try:
        reply = call(path, {"op": "incident", "job": job, "reason": reason})
    except FileNotFoundError:
        raise UserError(f"no profagent agent is running here (no control socket at {path})",
                        "start `profagent attach --pid N` (or the profagent service) first; if one runs, it has "
                        "incidents.enabled = false or another ondemand.control_socket") from None
    except OSError as exc:
        raise UserError(f"cannot talk to the agent at {path} ({exc})", "check that it runs and that you are its user (or root)") from None
    if not reply.get("ok"):
        error = str(reply.get("error", "unknown error"))
        if error.startswith("unknown op"):
            raise UserError("this agent cannot capture incidents", "set incidents.enabled = true and restart it")
        raise UserError(f"the agent did not capture: {error}", "see `profagent incidents list`")
    out = Console()
    out.print(f"incident {reply['id']}: {reply['path']}", highlight=False, soft_wrap=True)
    deadline = time.monotonic() + wait
    meta_path = Path(reply["path"]) / "incident.json"
    while time.monotonic() < deadline:
        try:
            if json.loads(meta_path.read_text()).get("status") == "complete":
                out.print("captured", highlight=False)
                return
        except (OSError, ValueError):
            pass  # not ours to read (root's folder) or not written yet
        time.sleep(0.5)
    if wait > 0:
        out.print("still capturing (or its folder is not readable by you): see `profagent incidents show ID`", highlight=False)

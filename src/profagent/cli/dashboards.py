"""``profagent dashboards``: a thin typer layer over ``exporters.grafana.publish``."""

from pathlib import Path
from typing import Annotated

import typer

dashboards_app = typer.Typer(
    name="dashboards",
    help="Export profagent's Grafana dashboards as provisioning files, or push them to a Grafana.",
    no_args_is_help=True,
    rich_markup_mode=None,  # plain help, as the main app
)


@dashboards_app.command("export")
def export_cmd(
    dest: Annotated[Path, typer.Argument(help="folder to write the dashboards and provisioning/ into")],
    grafana_path: Annotated[str | None, typer.Option("--grafana-path", help="where Grafana reads the JSON files (the provider's path) [default: DEST]")] = None,
) -> None:
    """Write the dashboards' JSON and Grafana provisioning files (datasource, provider) to DEST."""
    from profagent.exporters.grafana.publish import export

    written = export(dest, grafana_path)
    for path in written:
        typer.echo(str(path))
    typer.echo(
        f"point Grafana's provisioning at {dest / 'provisioning'} and set PROMETHEUS_URL in its environment",
        err=True,
    )


@dashboards_app.command("push")
def push_cmd(
    url: Annotated[str, typer.Option("--url", help="Grafana's root URL, e.g. http://grafana:3000")],
    token: Annotated[str | None, typer.Option("--token", envvar="GRAFANA_TOKEN", help="service account token (or $GRAFANA_TOKEN)")] = None,
    basic_auth: Annotated[str | None, typer.Option("--basic-auth", help="USER:PASS for basic authentication")] = None,
    folder: Annotated[str, typer.Option("--folder", help="Grafana folder to put the dashboards in (created if missing)")] = "profagent",
    timeout: Annotated[float, typer.Option("--timeout", help="seconds to wait for each Grafana request")] = 10.0,
    ca_file: Annotated[Path | None, typer.Option("--ca-file", help="CA certificate to verify an https Grafana [default: the system's CAs]")] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help="do not verify the https Grafana's certificate")] = False,
) -> None:
    """Upload the dashboards to a Grafana (idempotent: overwrites by uid, creates the folder)."""
    from profagent.exporters.grafana.publish import parse_credential, push

    for item in push(url, parse_credential(token, basic_auth), folder, timeout, ca_file=ca_file, insecure=insecure):
        typer.echo(f"{item.title}: {item.url}")

"""The command line: a thin layer that parses flags into config and calls the agent.

Every failure the user can fix ends in one line naming the problem and the fix, exit
status 2, and no traceback.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from profagent import __version__
from profagent.config import load_config
from profagent.errors import UserError

app = typer.Typer(
    name="profagent",
    help="Observe PyTorch training jobs from the outside: GPU, Python stacks, profiler traces -> Prometheus.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

ConfigOpt = Annotated[Path | None, typer.Option("--config", help="TOML config file (flags > PROFAGENT_* env > file > defaults)")]
LogLevelOpt = Annotated[str | None, typer.Option("--log-level", help="debug, info, warning or error")]


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="profagent %(levelname)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def _version(value: bool) -> None:
    if value:
        typer.echo(f"profagent {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")] = False,
) -> None:
    """profagent: why is my training job slow, idle, leaking or hung?"""


@app.command()
def attach(
    pid: Annotated[int, typer.Option("--pid", help="PID of the launcher (torchrun) or of a single rank")],
    listen: Annotated[str | None, typer.Option("--listen", help="HOST:PORT to serve /metrics on [default :19400]")] = None,
    interval: Annotated[float | None, typer.Option("--interval", help="default seconds between samples (>= 0.1) [default 1]")] = None,
    config: ConfigOpt = None,
    web_config: Annotated[Path | None, typer.Option("--web-config", help="web-config.yml with TLS and basic auth (exporter-toolkit format)")] = None,
    log_level: LogLevelOpt = None,
    exit_grace: Annotated[float | None, typer.Option("--exit-grace", help="seconds to keep serving after the target is gone [default 3]")] = None,
) -> None:
    """Attach to a running training job and export its metrics until it ends."""
    from profagent.agent.app import attach as run_attach

    cfg = load_config(
        config,
        os.environ,
        {
            "listen": listen,
            "interval": interval,
            "web_config": str(web_config) if web_config else None,
            "log_level": log_level,
            "exit_grace": exit_grace,
        },
    )
    _setup_logging(cfg.agent.log_level)
    raise typer.Exit(run_attach(cfg, pid, Console(stderr=True)))


@app.command("config")
def show_config(
    defaults: Annotated[bool, typer.Option("--defaults", help="print every key at its default as commented TOML")] = False,
    reference: Annotated[bool, typer.Option("--reference", help="print the Markdown table of every key")] = False,
    config: ConfigOpt = None,
) -> None:
    """Print the effective configuration (or a commented default file, or the key reference)."""
    from profagent.config import all_keys, default_toml, reference_markdown

    if defaults:
        typer.echo(default_toml(), nl=False)
        return
    if reference:
        typer.echo(reference_markdown(), nl=False)
        return
    cfg = load_config(config, os.environ)
    for key in all_keys():
        typer.echo(f"{key.dotted} = {getattr(cfg.section(key.section), key.name)!r}")


@app.command()
def doctor(config: ConfigOpt = None, log_level: LogLevelOpt = None) -> None:
    """Check what works here (NVML, ptrace, py-spy, Kineto endpoint) and how to fix the rest."""
    from rich.table import Table

    from profagent.doctor import FAIL, OK, run_checks

    cfg = load_config(config, os.environ, {"log_level": log_level})
    _setup_logging(cfg.agent.log_level)
    table = Table(title="profagent doctor")
    for col in ("area", "check", "status", "detail", "fix"):
        table.add_column(col)
    rows = run_checks(cfg)
    colors = {OK: "green", FAIL: "red"}
    for r in rows:
        color = colors.get(r.status, "yellow")
        table.add_row(r.area, r.name, f"[{color}]{r.status}[/{color}]", r.detail, r.fix)
    Console().print(table)
    raise typer.Exit(1 if any(r.status == FAIL for r in rows) else 0)


def main() -> None:
    """Console-script entry point."""
    try:
        app(standalone_mode=False)
    except UserError as exc:
        Console(stderr=True).print(f"[red]error[/red]: {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    except Exception as exc:  # click usage errors and the like
        from click.exceptions import ClickException

        if isinstance(exc, ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()

"""The command line: a thin layer that parses flags into config and calls the agent.

Every failure the user can fix ends in one line naming the problem and the fix, exit
status 2, and no traceback.

Only typer is imported at start-up: each command imports its implementation (and rich,
the config loader) inside its function, so `profagent --help` and `profagent analyze`
do not pay for the agent's sources, exporters and engine. The typer modules (this one,
``dashboards``, ``incidents``) keep eager annotations, without ``from __future__ import
annotations``: typer would compile and evaluate each command's string annotations on every
run, about 10 ms of every command (bench/startup.py).
"""

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from profagent import __version__
from profagent.cli.client import BasicAuthFileOpt, BasicAuthOpt, CaFileOpt, InsecureOpt
from profagent.cli.dashboards import dashboards_app
from profagent.cli.incidents import incidents_app
from profagent.errors import UserError

app = typer.Typer(
    name="profagent",
    help="Observe PyTorch training jobs from the outside: GPU, Python stacks, profiler traces -> Prometheus.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    # click's plain help: typer's rich panels import rich.markdown, rich.traceback and more,
    # which made `profagent --help` take ~150 ms instead of ~85 (bench/startup.py)
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120},
)
app.add_typer(dashboards_app, name="dashboards", short_help="Export the Grafana dashboards as files, or push them to a Grafana.")
app.add_typer(incidents_app, name="incidents", short_help="Incident bundles captured when a job hangs or slows down.")

ConfigOpt = Annotated[Path | None, typer.Option("--config", help="TOML config file (flags > PROFAGENT_* env > file > defaults)")]
LogLevelOpt = Annotated[str | None, typer.Option("--log-level", help="debug, info, warning or error")]
GpuBackendOpt = Annotated[str | None, typer.Option("--gpu-backend", help="nvml (default), off, or simulated, simulated:PROFILE or simulated:PROFILExN with PROFILE a100, h100 or h100-mig (e.g. simulated:h100x8), or simulated:FILE.yaml (a mock NVML configuration)")]


def _setup_logging(level: str) -> None:
    import logging  # here, not at start-up: `--help` and `analyze` never log

    from profagent.logs import PrintableFormatter, RateLimit, stderr_is_journal

    handler = logging.StreamHandler(sys.stderr)
    # journald stamps each line itself; anywhere else (a terminal, kubectl logs, a file) we do
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a buffer (tests, embedding)
        fd = -1
    timestamps = not stderr_is_journal(os.environ, fd)
    handler.setFormatter(PrintableFormatter("profagent %(levelname)s: %(message)s", timestamps=timestamps))
    handler.addFilter(RateLimit())
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)


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
    listen: Annotated[str | None, typer.Option("--listen", "--web.listen-address", help="HOST:PORT to serve /metrics on [default :19400]")] = None,
    interval: Annotated[float | None, typer.Option("--interval", help="default seconds between samples (>= 0.1) [default 1]")] = None,
    config: ConfigOpt = None,
    web_config: Annotated[Path | None, typer.Option("--web-config", "--web.config.file", help="web-config.yml with TLS and basic auth (exporter-toolkit format)")] = None,
    log_level: LogLevelOpt = None,
    exit_grace: Annotated[float | None, typer.Option("--exit-grace", help="seconds to keep serving after the target is gone [default 3]")] = None,
    stacks: Annotated[bool | None, typer.Option("--stacks/--no-stacks", help="sample Python stacks with py-spy [default on]")] = None,
    stack_rate: Annotated[int | None, typer.Option("--stack-rate", help="py-spy samples per second per process [default 20]")] = None,
    stack_dataloader: Annotated[bool | None, typer.Option("--stack-dataloader/--no-stack-dataloader", help="also sample DataLoader workers [default off]")] = None,
    timeline: Annotated[bool | None, typer.Option("--timeline/--no-timeline", help="step time and stages from kernel uprobes on libtorch (root) [default on]")] = None,
    trace_dir: Annotated[list[Path] | None, typer.Option("--trace-dir", help="folder watched for torch profiler traces (repeatable)")] = None,
    gpu_backend: GpuBackendOpt = None,
    gpus: Annotated[str | None, typer.Option("--gpus", help="comma-separated GPU indices to report, e.g. 0,1 (default: all)")] = None,
) -> None:
    """Attach to a running training job and export its metrics until it ends."""
    from rich.console import Console

    from profagent.config import load_config
    from profagent.engine.agent import attach as run_attach

    cfg = load_config(
        config,
        os.environ,
        {
            "listen": listen,
            "interval": interval,
            "web_config": str(web_config) if web_config else None,
            "log_level": log_level,
            "exit_grace": exit_grace,
            "stacks.enabled": stacks,
            "stacks.rate": stack_rate,
            "stacks.dataloader": stack_dataloader,
            "timeline.enabled": timeline,
            "traces.dirs": [str(d) for d in trace_dir] if trace_dir else None,
            "gpu.backend": gpu_backend,
            "gpu.gpus": gpus,
        },
    )
    _setup_logging(cfg.agent.log_level)
    raise typer.Exit(run_attach(cfg, pid, Console(stderr=True)))


@app.command(short_help="Node daemon: find and export every training job on this node.")
def watch(
    config: ConfigOpt = None,
    listen: Annotated[str | None, typer.Option("--listen", "--web.listen-address", help="HOST:PORT to serve /metrics on (default :19400)")] = None,
    interval: Annotated[float | None, typer.Option("--interval", help="default seconds between samples (>= 0.1) (default 1)")] = None,
    web_config: Annotated[Path | None, typer.Option("--web-config", "--web.config.file", help="web-config.yml with TLS and basic auth (exporter-toolkit format)")] = None,
    log_level: LogLevelOpt = None,
    cmdline_regex: Annotated[str | None, typer.Option("--cmdline-regex", help="watch processes whose command line matches (empty = rule off) [default: python running torchrun or a *train* script]")] = None,
    env_marker: Annotated[list[str] | None, typer.Option("--env-marker", help="watch processes with this NAME or NAME=VALUE in their environment (repeatable) (default PROFAGENT=1, KINETO_USE_DAEMON)")] = None,
    grace: Annotated[float | None, typer.Option("--grace", help="seconds an ended job's series stay (default 30)")] = None,
    max_jobs: Annotated[int | None, typer.Option("--max-jobs", help="jobs watched at once (default 16)")] = None,
    max_processes: Annotated[int | None, typer.Option("--max-processes-per-job", help="processes exported per job (default 256)")] = None,
    scan_interval: Annotated[float | None, typer.Option("--scan-interval", help="seconds between scans for new jobs (default 2)")] = None,
    stacks: Annotated[bool | None, typer.Option("--stacks/--no-stacks", help="sample Python stacks with py-spy (default on)")] = None,
    timeline: Annotated[bool | None, typer.Option("--timeline/--no-timeline", help="step time and stages from kernel uprobes on libtorch (root) (default on)")] = None,
    trace_dir: Annotated[list[Path] | None, typer.Option("--trace-dir", help="folder watched for torch profiler traces (repeatable)")] = None,
    gpu_backend: GpuBackendOpt = None,
) -> None:
    """Node daemon: find training jobs on this node, export all of them on one endpoint.

    SIGHUP reloads the config (the watch section and log_level) without dropping metrics.
    Under systemd (Type=notify) it sends READY, WATCHDOG, RELOADING and STOPPING.
    """
    from rich.console import Console

    from profagent.config import load_config
    from profagent.engine.node import set_log_level
    from profagent.engine.node import watch as run_watch

    overrides = {
        "listen": listen,
        "interval": interval,
        "web_config": str(web_config) if web_config else None,
        "log_level": log_level,
        "watch.cmdline_regex": cmdline_regex,
        "watch.env_markers": env_marker,
        "watch.grace_seconds": grace,
        "watch.max_jobs": max_jobs,
        "watch.max_processes_per_job": max_processes,
        "watch.scan_interval": scan_interval,
        "stacks.enabled": stacks,
        "timeline.enabled": timeline,
        "traces.dirs": [str(d) for d in trace_dir] if trace_dir else None,
        "gpu.backend": gpu_backend,
    }
    cfg = load_config(config, os.environ, overrides)
    _setup_logging(cfg.agent.log_level)
    set_log_level(cfg.agent.log_level)
    raise typer.Exit(run_watch(cfg, lambda: load_config(config, os.environ, overrides), Console(stderr=True)))


@app.command("install-service", short_help="Install the systemd units and a commented config file.")
def install_service(
    prefix: Annotated[Path, typer.Option("--prefix", help="install under this root (units in PREFIX/etc/systemd/system, config in PREFIX/etc/profagent)")] = Path("/"),
    executable: Annotated[str | None, typer.Option("--executable", help="absolute path of profagent for ExecStart [default: the installed one]")] = None,
) -> None:
    """Install profagent.service, profagent-attach@.service and a commented default config."""
    from profagent.system.service import install

    done = install(prefix, executable)
    for unit in done.units:
        typer.echo(f"installed {unit}")
    state = "written" if done.config_written else "kept (already there)"
    typer.echo(f"config {done.config} {state}")
    typer.echo(f"ExecStart uses {done.executable}")
    if Path(prefix).resolve() == Path("/"):
        typer.echo("next: systemctl daemon-reload && systemctl enable --now profagent")


@app.command("stacks")
def stacks_cmd(
    pid: Annotated[int, typer.Option("--pid", help="PID of a running Python process")],
    output: Annotated[Path, typer.Option("--output", "-o", help="file to write")],
    seconds: Annotated[int, typer.Option("--seconds", min=1, help="how long to sample")] = 10,
    fmt: Annotated[str, typer.Option("--format", help="flamegraph (SVG), speedscope (JSON) or folded (text)")] = "flamegraph",
    rate: Annotated[int, typer.Option("--rate", min=1, help="samples per second")] = 100,
    blocking: Annotated[bool, typer.Option("--blocking", help="pause the target for each sample (exact, slower)")] = False,
    idle: Annotated[bool, typer.Option("--idle/--no-idle", help="include threads that wait (sleep, locks, queues)")] = False,
    log_level: LogLevelOpt = None,
) -> None:
    """Record a flamegraph of one process with py-spy, without a running agent."""
    from profagent.cli.stacks import record_to_file

    _setup_logging(log_level or "info")
    samples = record_to_file(pid, seconds, fmt, output, rate=rate, nonblocking=not blocking, idle=idle)
    typer.echo(f"wrote {output} ({fmt}, {samples} samples)")


@app.command(short_help="Live view of a job, one row per rank, under its findings.")
def top(
    pid: Annotated[int | None, typer.Option("--pid", help="observe this job (launcher or rank PID) with an agent run inside `top`")] = None,
    url: Annotated[str | None, typer.Option("--url", help="read a running agent instead, e.g. http://127.0.0.1:19400")] = None,
    once: Annotated[bool, typer.Option("--once", help="print one snapshot as plain text and exit")] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.2, help="seconds between refreshes")] = 1.0,
    basic_auth: BasicAuthOpt = None,
    basic_auth_file: BasicAuthFileOpt = None,
    ca_file: CaFileOpt = None,
    insecure: InsecureOpt = False,
    config: ConfigOpt = None,
    gpu_backend: GpuBackendOpt = None,
    log_level: LogLevelOpt = None,
) -> None:
    """Live view of a whole job, one row per rank: state, stacks, CPU, memory, GPU, step time.

    Keys: up/down select a rank, enter shows its top functions and current stack,
    s changes the sort, q quits. Not on a terminal (or with --once) it prints plain tables.
    """
    from rich.console import Console

    from profagent.cli.client import client_auth
    from profagent.cli.top import run_top
    from profagent.config import load_config

    if (pid is None) == (url is None):
        raise UserError("choose what to show", "give exactly one of --pid N (run an agent here) or --url URL (a running agent)")
    auth = client_auth(basic_auth, basic_auth_file, ca_file, insecure)
    # Our own agent must not collide with a running one: no control socket, no Kineto listener.
    cfg = load_config(config, os.environ, {"log_level": log_level or "error", "gpu.backend": gpu_backend,
                                           "ondemand.enabled": False if pid is not None else None})
    _setup_logging(cfg.agent.log_level)
    run_top(cfg, pid, url, auth, once=once, interval=interval, console=Console())


@app.command("config", short_help="Print the effective configuration, a default file, or the keys.")
def show_config(
    defaults: Annotated[bool, typer.Option("--defaults", help="print every key at its default as commented TOML")] = False,
    reference: Annotated[bool, typer.Option("--reference", help="print the Markdown table of every key")] = False,
    config: ConfigOpt = None,
) -> None:
    """Print the effective configuration as TOML (`profagent config > c.toml` gives a file
    --config reads back), or a commented default file, or the key reference."""
    from profagent.config import default_toml, effective_toml, load_config, reference_markdown

    if defaults:
        typer.echo(default_toml(), nl=False)
        return
    if reference:
        typer.echo(reference_markdown(), nl=False)
        return
    typer.echo(effective_toml(load_config(config, os.environ)), nl=False)


@app.command(short_help="Check what works here (NVML, ptrace, py-spy, Kineto) and how to fix it.")
def doctor(config: ConfigOpt = None, log_level: LogLevelOpt = None, gpu_backend: GpuBackendOpt = None) -> None:
    """Check what works here (NVML, ptrace, py-spy, Kineto endpoint) and how to fix the rest."""
    from rich.console import Console
    from rich.table import Table

    from profagent.config import load_config
    from profagent.doctor import FAIL, OK, run_checks

    cfg = load_config(config, os.environ, {"log_level": log_level, "gpu.backend": gpu_backend})
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


@app.command(short_help="Analyse torch profiler traces offline (files or folders).")
def analyze(
    files: Annotated[list[Path], typer.Argument(help="Kineto traces (.json or .json.gz) or folders of them", show_default=False)],
    json_out: Annotated[bool, typer.Option("--json", help="print the report as JSON instead of tables")] = False,
    top_k: Annotated[int, typer.Option("--top", help="kernels and ops listed per trace")] = 10,
    details: Annotated[bool, typer.Option("--details", help="full report of every trace, also with many traces")] = False,
    straggler_threshold: Annotated[float, typer.Option(
        "--straggler-threshold", help="a rank is the straggler when its collectives are this much shorter "
        "than the other ranks' median (0.25: 25%)")] = 0.25,
) -> None:
    """Analyse torch profiler traces offline: steps, breakdown, GPU idle, tops, findings, cross-rank summary."""
    from profagent.cli.analyze import analyze_files

    _skip_teardown()
    if not 0 < straggler_threshold < 1:
        raise UserError(f"--straggler-threshold {straggler_threshold} is out of range", "pass a share between 0 and 1, e.g. 0.25")
    raise typer.Exit(analyze_files(files, json_out, top_k, None, details=details,
                                   straggler_threshold=straggler_threshold))


@app.command(short_help="My run got slower: compare two runs' traces, per step.")
def diff(
    baseline: Annotated[Path, typer.Argument(help="the run before: a trace file or a folder of one job's traces", show_default=False)],
    current: Annotated[Path, typer.Argument(help="the run after: a trace file or a folder of one job's traces", show_default=False)],
    json_out: Annotated[bool, typer.Option("--json", help="print the diff as JSON instead of tables")] = False,
) -> None:
    """Compare two runs side by side (step time, breakdown, GPU idle, memory, top kernels
    and ops) and rank what changed by its contribution to the step time, per step."""
    from profagent.cli.diff import diff_command

    _skip_teardown()
    raise typer.Exit(diff_command(baseline, current, json_out))


@app.command(short_help="Take a torch profiler trace of a running job, no code change.")
def trace(
    pid: Annotated[int | None, typer.Option("--pid", help="trace this process, or the ranks under this launcher PID")] = None,
    job: Annotated[str | None, typer.Option("--job", help="trace every polling process of this job_id")] = None,
    all_: Annotated[bool, typer.Option("--all", help="trace every process polling the agent")] = False,
    duration_ms: Annotated[int, typer.Option("--duration-ms", help="length of the trace window")] = 500,
    iterations: Annotated[int, typer.Option("--iterations", help="trace N optimizer steps instead of a duration")] = 0,
    record_shapes: Annotated[bool, typer.Option("--record-shapes", help="record operator input shapes")] = False,
    profile_memory: Annotated[bool, typer.Option("--profile-memory", help="record memory allocations")] = False,
    with_stack: Annotated[bool, typer.Option("--with-stack", help="record Python stacks of ops")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds to wait for the traces")] = 60.0,
    json_out: Annotated[bool, typer.Option("--json", help="print the reports as JSON")] = False,
    config: ConfigOpt = None,
    log_level: LogLevelOpt = None,
) -> None:
    """Take a torch profiler trace of a running job, no code change (KINETO_USE_DAEMON=1)."""
    from rich.console import Console

    from profagent.cli.analyze import analyze_files
    from profagent.cli.trace import TraceRequestArgs, request_trace
    from profagent.config import load_config
    from profagent.system.unixsock import default_control_socket

    cfg = load_config(config, os.environ, {"log_level": log_level})
    _setup_logging(cfg.agent.log_level)
    console = Console(stderr=True)
    out = Console()
    args = TraceRequestArgs(pid, job, all_, duration_ms, iterations, record_shapes, profile_memory, with_stack, timeout)
    request_trace(
        cfg.ondemand.control_socket or default_control_socket(), args, console,
        report=lambda ranks: analyze_files(list(ranks), json_out, cfg.traces.top_k, out, ranks=ranks,
                                           iteration_window=iterations > 0),
    )


@app.command(short_help="What is wrong with a job now, from its findings, with the evidence.")
def diagnose(
    pid: Annotated[int | None, typer.Option("--pid", help="observe this launcher or rank PID in-process for --seconds (no agent needed)")] = None,
    job: Annotated[str | None, typer.Option("--job", help="only this job_id (from the agent at --url, default the local one)")] = None,
    url: Annotated[str | None, typer.Option("--url", help="a running agent, e.g. http://node1:19400 [default with --job: http://127.0.0.1:19400]")] = None,
    prometheus: Annotated[str | None, typer.Option("--prometheus", help="a Prometheus (or Thanos, Mimir) scraping every node's agent, e.g. http://prometheus:9090: one verdict per job across nodes")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print {findings, time} as JSON")] = False,
    seconds: Annotated[float, typer.Option("--seconds", help="with --pid: how long to observe (a hang needs stacks.stall_seconds, a leak findings.leak_min_span_seconds)")] = 30.0,
    stall_seconds: Annotated[float | None, typer.Option("--stall-seconds", help="with --pid: stacks.stall_seconds")] = None,
    basic_auth: BasicAuthOpt = None,
    basic_auth_file: BasicAuthFileOpt = None,
    ca_file: CaFileOpt = None,
    insecure: InsecureOpt = False,
    config: ConfigOpt = None,
    log_level: LogLevelOpt = None,
) -> None:
    """What is wrong with a job now: hang (and its culprit rank), straggler, leaks... ranked by severity."""
    import json as jsonlib

    from rich.console import Console

    from profagent.cli.client import client_auth
    from profagent.cli.diagnose import LOCAL_AGENT, collect_local, fetch, render
    from profagent.config import load_config

    if sum(x is not None for x in (pid, url, prometheus)) > 1:
        raise UserError("give one of --pid, --url and --prometheus",
                        "--pid observes in-process; --url asks a running agent; --prometheus asks Prometheus for every node")
    if pid is None and url is None and job is None and prometheus is None:
        raise UserError("nothing to diagnose", "give --pid N, --job ID, --url http://HOST:19400 or --prometheus http://HOST:9090")
    auth = client_auth(basic_auth, basic_auth_file, ca_file, insecure)
    cfg = load_config(config, os.environ, {"log_level": log_level, "stacks.stall_seconds": stall_seconds})
    _setup_logging(cfg.agent.log_level)
    if prometheus is not None:
        from profagent.cli.prometheus import diagnose as diagnose_prometheus

        body = diagnose_prometheus(prometheus, job, auth)
    elif pid is not None:
        body = collect_local(cfg, pid, seconds, Console(stderr=True))
        if job:
            body["findings"] = [f for f in body["findings"] if f["job_id"] == job]
    else:
        body = fetch(url or LOCAL_AGENT, job, auth)
    if json_out:
        typer.echo(jsonlib.dumps(body, indent=2))
    else:
        render(body, Console())


@app.command(short_help="A picture of every rank's recent steps (Perfetto, chrome://tracing).")
def timeline(
    output: Annotated[Path, typer.Option("--output", "-o", help="the picture's file (Chrome trace JSON)")] = Path("timeline.json"),
    pid: Annotated[int | None, typer.Option("--pid", help="observe this launcher or rank PID in-process for --seconds (root: kernel probes)")] = None,
    url: Annotated[str | None, typer.Option("--url", help="a running agent, e.g. http://node1:19400")] = None,
    prometheus: Annotated[str | None, typer.Option("--prometheus", help="a Prometheus scraping every node's agent: ask each agent of --job and merge them")] = None,
    job: Annotated[str | None, typer.Option("--job", help="the job_id (needed with --prometheus)")] = None,
    seconds: Annotated[float, typer.Option("--seconds", min=1.0, help="the last S seconds of steps (with --pid: how long to observe)")] = 60.0,
    rank: Annotated[list[str] | None, typer.Option("--rank", help="only this rank (repeatable)")] = None,
    basic_auth: BasicAuthOpt = None,
    basic_auth_file: BasicAuthFileOpt = None,
    ca_file: CaFileOpt = None,
    insecure: InsecureOpt = False,
    config: ConfigOpt = None,
    log_level: LogLevelOpt = None,
) -> None:
    """Every rank's steps of the last --seconds as one picture: data wait, forward, backward
    and optimizer as spans, each collective's arrival with its lag, one track per rank, one
    clock for all nodes. Open the file at https://ui.perfetto.dev or in chrome://tracing."""
    from rich.console import Console

    from profagent.cli import picture
    from profagent.cli.client import client_auth
    from profagent.config import load_config

    if sum(x is not None for x in (pid, url, prometheus)) != 1:
        raise UserError("give one of --pid, --url and --prometheus",
                        "--pid observes in-process; --url asks a running agent; --prometheus --job ID asks every node's agent")
    if prometheus is not None and not job:
        raise UserError("--prometheus needs --job ID", "give the job_id whose ranks to draw (profagent_optimizer_steps_total's job_id)")
    auth = client_auth(basic_auth, basic_auth_file, ca_file, insecure)
    cfg = load_config(config, os.environ, {"log_level": log_level or "warning", "gpu.backend": "off" if pid is not None else None})
    _setup_logging(cfg.agent.log_level)
    ranks = list(rank or [])
    if prometheus is not None:
        histories = picture.from_agents(picture.agents_of_job(prometheus, str(job), auth), seconds, ranks, job, auth)
    elif url is not None:
        histories = [picture.from_agent(url, seconds, ranks, job, auth)]
    else:
        assert pid is not None
        history = picture.from_pid(cfg, pid, seconds, Console(stderr=True))
        import dataclasses

        histories = [dataclasses.replace(history, ranks=tuple(
            r for r in history.ranks if (not ranks or r.rank in ranks) and job in (None, r.job_id)))]
    typer.echo(picture.write_picture(histories, seconds, output))


# Names users reach for that mean one of our flags. Click's own suggestion is by spelling
# only (difflib), so `stacks --duration` used to suggest --rate.
OPTION_SYNONYMS = {
    "--duration": ("--seconds", "--duration-ms"),
    "--time": ("--seconds", "--duration-ms"),
    "--secs": ("--seconds",),
    "--port": ("--listen",),
    "--out": ("--output",),
    "--file": ("--output", "--config"),
    "--endpoint": ("--url",),
}


def unknown_option_message(exc: Exception) -> str | None:
    """For an unknown option: the message naming the flag the user most likely meant."""
    option = getattr(exc, "option_name", None)
    ctx = getattr(exc, "ctx", None)
    if not option or ctx is None:
        return None
    known = {name for p in ctx.command.params for name in getattr(p, "opts", ()) + getattr(p, "secondary_opts", ())}
    meant = [o for o in OPTION_SYNONYMS.get(option.split("=", 1)[0], ()) if o in known]
    if not meant:
        meant = sorted(getattr(exc, "possibilities", None) or ())
    return f"No such option: {option}" + (f" (did you mean {' or '.join(meant)}?)" if meant else "")


_TEARDOWN = {"skip": False}


def _skip_teardown() -> None:
    """An offline command (analyze, diff) holds nothing to clean up at exit (no child, socket
    or file of its own): ``main`` ends it with ``os._exit`` once its output is flushed,
    sparing the interpreter's teardown of numpy and every module (about 25 ms of a 0.4 s run)."""
    _TEARDOWN["skip"] = True


def _exit(code: int) -> None:
    if _TEARDOWN["skip"]:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (BrokenPipeError, ValueError):  # output closed early (`| head`): nothing more to say
            pass
        else:
            os._exit(code)
    sys.exit(code)


def main() -> None:
    """Console-script entry point: user errors and usage errors end in one line, exit 2."""
    _TEARDOWN["skip"] = False  # set by the command this call runs (not an earlier one in-process)
    def error_line(text: str) -> None:
        from rich.console import Console  # only on the error path: start-up stays lean
        from rich.markup import escape

        from profagent.labels import printable  # a path or a name in the message is data

        Console(stderr=True).print(f"[red]error[/red]: {escape(printable(text))}", highlight=False, soft_wrap=True)

    # numpy's OpenBLAS starts a thread per core when numpy is imported, although profagent
    # does no linear algebra: one thread makes `profagent analyze` start faster on big nodes.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        code = app(standalone_mode=False)  # typer.Exit(n) raised by a command comes back as n
    except UserError as exc:
        error_line(str(exc))
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        _exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    except typer.TyperException as exc:  # bad flags or arguments (typer's vendored click)
        message = unknown_option_message(exc) or (exc.format_message() if hasattr(exc, "format_message") else str(exc))
        if message.strip():  # empty when the help was shown instead
            error_line(f"{message} (see `profagent --help`)")
        sys.exit(getattr(exc, "exit_code", 2))
    code = code if isinstance(code, int) else 0
    if code or _TEARDOWN["skip"]:  # a command's failure is the process's exit status
        _exit(code)


if __name__ == "__main__":
    main()

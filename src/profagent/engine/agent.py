"""The composition root: config -> target, sources, state, runtime, exporter.

``attach()`` is what ``profagent attach`` runs. Everything is built here and passed
down; nothing is created at import time.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from profagent.analysis.findings.steps import pausing_jobs, stepped_within
from profagent.config import Config, parse_listen
from profagent.contracts import StateView
from profagent.engine.control import ControlledOndemand, ControlServer
from profagent.engine.findings import FindingsEngine
from profagent.engine.incidents.store import IncidentStore, incidents_dir, rate_limits_path
from profagent.engine.incidents.trigger import IncidentsSource
from profagent.engine.runtime import Runtime
from profagent.errors import SourceUnavailable
from profagent.exporters.api import ROUTES, ApiProviders
from profagent.exporters.exposition import Exposition
from profagent.exporters.http import AgentHTTPServer, HttpLimits, load_web_config
from profagent.labels import printable, set_value_max
from profagent.sources import Source
from profagent.sources.gpu.source import GpuSource, build_gpu_source
from profagent.sources.host import HostSource
from profagent.sources.ondemand.kineto import TraceOptions
from profagent.sources.ondemand.source import OndemandSource
from profagent.sources.stacks.source import StacksSource
from profagent.sources.timeline.source import TimelineSource
from profagent.sources.traces.source import traces_source
from profagent.state import State
from profagent.system.unixsock import default_control_socket
from profagent.target import PidTarget, check_attachable, not_a_training_job

log = logging.getLogger(__name__)

FRESH_FINDING = 300.0  # seconds a new finding keeps py-spy at the full rate


@dataclass(frozen=True)
class Disabled:
    """A source switched off by configuration, shown in the banner."""

    name: str
    why: str


def build_sources(config: Config) -> tuple[list[Source], list[Disabled]]:
    """Every source the configuration turns on, and why the others are off."""
    sources: list[Source] = []
    disabled: list[Disabled] = []
    if config.host.enabled:
        sources.append(HostSource(interval=config.interval_of("host")))
    else:
        disabled.append(Disabled("host", "host.enabled = false"))
    gpu = build_gpu_source(config)  # raises UserError for a malformed gpu.backend / gpu.gpus
    if gpu is not None:
        sources.append(gpu)
    else:
        disabled.append(Disabled("gpu", "gpu.backend = off"))
    if config.stacks.enabled:
        sources.append(StacksSource(config.stacks, interval=config.interval_of("stacks")))
    else:
        disabled.append(Disabled("stacks", "stacks.enabled = false (--no-stacks)"))
    if config.timeline.enabled:
        sources.append(TimelineSource(config.timeline, interval=config.interval_of("timeline")))
    else:
        disabled.append(Disabled("timeline", "timeline.enabled = false (--no-timeline)"))
    if config.ondemand.enabled:
        ondemand = OndemandSource(
            interval=config.interval_of("ondemand"),
            trace_dir=config.ondemand.trace_dir,
            socket_dir=config.ondemand.socket_dir,
            periodic_minutes=config.ondemand.periodic_minutes,
            keep=config.ondemand.keep,
            periodic_options=TraceOptions(duration_ms=config.ondemand.periodic_duration_ms),
            max_pollers=config.ondemand.max_pollers,
            max_pollers_per_user=config.ondemand.max_pollers_per_user,
        )
        sources.append(ControlledOndemand(ondemand, config.ondemand.control_socket or default_control_socket()))
    else:
        disabled.append(Disabled("ondemand", "ondemand.enabled = false"))
    # On-demand traces land in their own folder, which the trace watcher also ingests.
    trace_dirs = list(config.traces.dirs)
    if config.ondemand.enabled and config.ondemand.trace_dir not in trace_dirs:
        trace_dirs.append(config.ondemand.trace_dir)
    if trace_dirs:
        sources.append(traces_source(dataclasses.replace(
            config, traces=dataclasses.replace(config.traces, dirs=trace_dirs)), user_dirs=bool(config.traces.dirs)))
    else:
        disabled.append(Disabled("traces", "no --trace-dir given"))
    return sources, disabled


class Job:
    """One observed job: its target, sources, state and runtime."""

    def __init__(self, config: Config, pid: int, target: PidTarget | None = None) -> None:
        """``target`` replaces ``PidTarget(pid)`` (watch mode passes a NodeTarget)."""
        set_value_max(config.agent.max_label_bytes)  # before the first environment is read
        self.pid = pid
        self.stall_seconds = config.stacks.stall_seconds
        self.watch = target is not None  # a node target: every job of the node, not one tree
        self.state = State()
        self.target = target if target is not None else PidTarget(pid, cmdline_args=config.agent.cmdline_args)
        self.sources, self.disabled = build_sources(config)
        self.control_path = config.ondemand.control_socket or default_control_socket()
        self.engine_ops: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {}  # served on the control socket
        self.engine_control: ControlServer | None = None  # the socket's own server, with on-demand off
        for source in self.sources:
            if isinstance(source, StacksSource):
                source.busy = self.rank_busy  # a stall needs the rank's steps stopped and its GPUs idle
                source.job_hot = self.has_findings  # py-spy at the full rate while a finding is active
            if isinstance(source, GpuSource):  # per-field NVML errors -> collector_errors_total
                source.record_error = functools.partial(self.state.record_error, "gpu")
        self.incidents = self._incidents(config)
        self.runtime = Runtime(self.target, self.sources, self.state, interval=config.agent.interval)
        self.findings: FindingsEngine | None = None
        if config.findings.enabled:
            self.findings = FindingsEngine(config.findings, self.state)
            self.runtime.add_hook("findings", self.findings.tick)

    def _incidents(self, config: Config) -> IncidentsSource | None:
        """The incident trigger and capture, fed by this job's state; `profagent incidents
        capture` reaches it through the control socket (op "incident")."""
        if not config.incidents.enabled:
            self.disabled.append(Disabled("incidents", "incidents.enabled = false"))
            return None
        control = next((s for s in self.sources if isinstance(s, ControlledOndemand)), None)
        source = IncidentsSource(
            config.incidents, incidents_dir(config.incidents, config.agent.state_dir), self.state,
            interval=config.agent.interval, ondemand=control.source if control else None,
            timeline=next((s for s in self.sources if isinstance(s, TimelineSource)), None),
            rate_file=rate_limits_path(config.agent.state_dir), max_trace_bytes=config.traces.max_file_bytes,
            max_pyspy=config.stacks.max_pyspy,
        )
        self.engine_ops["incident"] = lambda req: source.request(
            str(req["job"]) if req.get("job") else None, str(req.get("reason") or ""))
        if control is not None:
            control.control.handlers.update(self.engine_ops)
        self.sources.append(source)
        return source

    def rank_busy(self, rank: str, job_id: str | None = None) -> bool | None:
        """Whether the rank works, for the stacks source's stall verdict: True when its kernel
        probes saw an optimizer step within stacks.stall_seconds (a rank waiting for a
        straggler in every step can show that one wait in every sample of a window), else
        what its GPUs say from the GPU source's latest snapshot (None: unknown)."""
        view = self.state.view()
        if stepped_within(view.timeline, job_id, rank, self.stall_seconds):
            return True
        return view.gpu.rank_busy(rank, job_id=job_id or None) if view.gpu is not None else None

    def has_findings(self, job_id: str) -> bool:
        """Whether a finding began on the job in the last FRESH_FINDING seconds (from the
        findings engine's latest tick), or its steps paused (the kernel probes): one that
        has lasted longer is established, and the steady pace keeps it tracked."""
        view = self.state.view()
        if job_id in pausing_jobs(view.timeline):  # its steps paused: a stall warning may need its line
            return True
        snapshot = view.findings
        return snapshot is not None and any(
            f.job_id in ("", job_id) and snapshot.time - f.since < FRESH_FINDING for f in snapshot.findings)

    def watched(self) -> None:
        """Someone looks at the ranks (`profagent top`): sample stacks at the full rate."""
        for source in self.sources:
            if isinstance(source, StacksSource):
                source.watched()

    def start(self) -> None:
        self.runtime.start()
        self._serve_engine_ops()

    def _serve_engine_ops(self) -> None:
        """The engine's ops (``incident``) ride on the on-demand source's control socket;
        with that source off, they get a control socket of their own."""
        control = next((s for s in self.sources if isinstance(s, ControlledOndemand)), None)
        if not self.engine_ops or (control is not None and control.control.bound):
            return
        health = self.state.view().health.get("ondemand")
        reason = (health.detail if health is not None and health.detail else
                  next((d.why for d in self.disabled if d.name == "ondemand"), "on-demand tracing is off"))
        engine_control = ControlServer(self.control_path, None, reason)
        engine_control.handlers.update(self.engine_ops)
        try:
            engine_control.start()
        except (SourceUnavailable, OSError) as exc:  # never fatal: the sources run on without it
            log.info("no control socket for `profagent incidents capture`: %s", exc)
            return
        self.engine_control = engine_control

    def stop(self) -> None:
        self.runtime.stop()
        if self.engine_control is not None:
            self.engine_control.stop()


class Agent:
    """The HTTP endpoint and the one job it serves (a PID's tree, or the node's jobs in watch)."""

    def __init__(self, config: Config, job: Job) -> None:
        self.config = config
        self.job = job
        web = load_web_config(config.agent.web_config) if config.agent.web_config else None
        host, port = parse_listen(config.agent.listen)
        self.exposition = Exposition(job.state.view, max_series_per_job=config.agent.max_series_per_job)
        job.state.subscribe(self.exposition.prerender)  # encode in the source's thread, not on scrape
        limits = HttpLimits(**dataclasses.asdict(config.http))
        self.server = AgentHTTPServer(host, port, self.exposition, web, limits)
        store = IncidentStore(incidents_dir(config.incidents, config.agent.state_dir))
        providers = ApiProviders(
            node=socket.gethostname(),
            views=lambda: [job.state.view()],
            watched=job.watched,
            stacks=lambda: [s for s in job.sources if isinstance(s, StacksSource)],
            findings=lambda: [job.state.view().findings] if job.findings is not None else [],
            incidents=store.list,
            job_ids=None if job.watch else lambda: _job_ids(job),
            timeline=lambda: [s for s in job.sources if isinstance(s, TimelineSource) and s.running],
        )
        for path, build in ROUTES.items():
            self.server.add_route(path, build(providers))
        self.server.health_detail = lambda: health_lines(job.state.view())

    def start(self) -> None:
        """Bind first (a taken port fails before anything runs), then start the job;
        /healthz says "ok" once every source has started or been turned off."""
        self.server.ready.clear()
        self.server.start()
        try:
            self.job.start()
        except BaseException:
            self.stop()
            raise
        self.server.ready.set()

    def stop(self) -> None:
        self.job.stop()
        self.server.shutdown()

    def stop_within(self, seconds: float) -> bool:
        """``stop()`` in a daemon thread, given up on after ``seconds`` (whatever is left is a
        daemon thread or a py-spy child bound to us, gone with the process). True if done."""
        stopper = threading.Thread(target=self.stop, name="profagent-stop", daemon=True)
        stopper.start()
        stopper.join(seconds)
        if stopper.is_alive():
            log.warning("stopping took over %g s: exiting anyway", seconds)
        return not stopper.is_alive()


def _job_ids(job: Job) -> list[str]:
    """The job ids an attached agent observes (its tree's), for /api/incidents."""
    tree = job.state.view().tree
    return list(tree.job_status()) if tree is not None else []


BANNER_INDENT = 6  # continuation lines of a banner line, under its text


def banner_line(console: Console, markup: str) -> None:
    """One line of a start banner. On a terminal it wraps at words, its continuation lines
    indented under it (a long reason why a source is off); elsewhere (a log, journald) it
    stays one line, whatever the width."""
    if not console.is_terminal:
        console.print(markup, highlight=False, soft_wrap=True)
        return
    text = Text.from_markup(markup)
    lines = text.wrap(console, max(20, console.width - BANNER_INDENT))
    for i, line in enumerate(lines):
        console.print(Text(" " * BANNER_INDENT) + line if i else line, highlight=False, soft_wrap=True)


def health_lines(view: StateView) -> list[str]:
    """/healthz?verbose=1: each collector on, or off and why (retrying: it takes its
    resource once free; not_applicable: nothing to do here)."""
    lines = []
    for name, health in sorted(view.health.items()):
        if health.up:
            lines.append(f"{name}: on")
        else:
            why = f" (retrying: {health.retrying})" if health.retrying else \
                f" (not_applicable: {health.not_applicable})" if health.not_applicable else ""
            lines.append(f"{name}: off{why}: {health.detail}")
    return lines


def print_banner(agent: Agent, job: Job, console: Console) -> None:
    view = job.state.view()
    tree = view.tree
    console.print(f"[bold]profagent[/bold] attached to PID {job.pid}")
    if tree is not None:
        ranks = tree.ranks()
        roles: dict[str, int] = {}
        for p in tree.processes:
            roles[p.role] = roles.get(p.role, 0) + 1
        parts = ", ".join(f"{n} {role}" for role, n in sorted(roles.items()))
        shown = escape(printable(f"{tree.job_id}: ranks {', '.join(ranks) or '-'}"))  # the job's own words
        banner_line(console, f"  job {shown} ({parts})")
    for name, health in sorted(view.health.items()):
        state = "[green]on[/green]" if health.up else f"[yellow]off[/yellow]: {health.detail}"
        note = next((getattr(s, "note", "") for s in job.sources if s.name == name), "") if health.up else ""
        banner_line(console, f"  source {name}: {state}{f' ({note})' if note else ''}")
    for d in job.disabled:
        banner_line(console, f"  source {d.name}: [yellow]off[/yellow]: {d.why}")
    console.print(f"  metrics: {agent.server.url}", highlight=False)


def install_stop_signals(stop: threading.Event) -> Callable[[], None]:
    """SIGINT/SIGTERM set ``stop``; returns a function restoring the old handlers."""
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in old:
        signal.signal(sig, lambda *_: stop.set())
    return lambda: [signal.signal(sig, handler) for sig, handler in old.items()]  # type: ignore[func-returns-value]


STOP_DEADLINE = 1.8  # seconds attach spends stopping: 2 s in all with CPU to spare, more on a loaded node (README)
FINAL_SCRAPE_WAIT = 60.0  # seconds an agent that was scraped waits for one scrape after its job ended


def done_serving(exposition: Exposition, gone_for: float, exit_grace: float, now: float) -> bool:
    """Whether attach may exit: the job has been gone for ``exit_grace`` and, if anyone
    scrapes this agent, a scrape has seen the job ended (``profagent_target_up 0``), so
    the ProfagentAgentDown rule can tell "ended with its job" from "died" (or
    FINAL_SCRAPE_WAIT has passed)."""
    if gone_for <= exit_grace:
        return False
    last = exposition.last_render
    return last is None or last >= now - gone_for or gone_for > exit_grace + FINAL_SCRAPE_WAIT


def attach(config: Config, pid: int, console: Console) -> int:
    """Run until a signal, or until the target tree has been gone for ``exit_grace`` (and,
    when scraped, until one scrape has seen it gone)."""
    warning = not_a_training_job(check_attachable(pid))
    job = Job(config, pid)
    agent = Agent(config, job)
    stop = threading.Event()
    restore = install_stop_signals(stop)
    started = None
    try:
        agent.start()
        started = time.monotonic()
        print_banner(agent, job, console)
        if warning:
            console.print(f"[yellow]warning[/yellow]: {warning}", highlight=False, soft_wrap=True)
        while not stop.wait(0.2):
            if done_serving(agent.exposition, job.runtime.target_gone_for(), config.agent.exit_grace, time.monotonic()):
                log.info("target PID %d and its whole tree are gone: exiting", pid)
                break
    finally:
        stopping = time.monotonic()
        agent.stop_within(STOP_DEADLINE)
        restore()
        if started is not None:
            # when the agent's part ended: the kernel disarms the timeline's probes as the
            # process exits, after it (README, on SIGTERM)
            log.info("stopped in %.1f s; exiting", time.monotonic() - stopping)
    return 0

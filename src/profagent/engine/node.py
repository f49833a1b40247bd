"""``profagent watch``: the node daemon. One runtime, one set of sources, one endpoint.

The target is a ``NodeTarget`` (``target/node.py``) that finds every training job of the
node; the rest is the attach machinery. systemd's notify protocol, the watchdog and SIGHUP
reloads are ``NodeDaemon``'s (the comment above it says what each means).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, runtime_checkable

from rich.console import Console

from profagent.config import Config, all_keys
from profagent.engine.agent import Agent, Job, banner_line
from profagent.errors import UserError
from profagent.system.sdnotify import Notifier
from profagent.target.node import Limits, NodeTarget, Rules

log = logging.getLogger(__name__)

RELOADABLE = ("log_level",)  # plus every watch.* key
TICK = 0.2


@runtime_checkable
class GpuProcessLister(Protocol):
    """The hook for the ``watch.gpu_processes`` rule: a source that knows which PIDs hold
    a GPU context (from its last tick, without calling NVML) implements this."""

    def gpu_pids(self) -> Iterable[int]: ...


def _gpu_pids(job: Job) -> Callable[[], Iterable[int]] | None:
    listers = [s for s in job.sources if isinstance(s, GpuProcessLister)]
    if not listers:
        return None
    return lambda: {pid for s in listers for pid in s.gpu_pids()}


def build(config: Config) -> tuple[Agent, Job, NodeTarget]:
    """The agent, its one job and the node target. Raises UserError for bad settings."""
    target = NodeTarget(Rules.from_config(config.watch), Limits.from_config(config.watch),
                        cmdline_args=config.agent.cmdline_args)
    job = Job(config, 0, target=target)  # type: ignore[arg-type]  # NodeTarget is Target-like
    target.set_gpu_pids(_gpu_pids(job) if config.watch.gpu_processes else None)
    return Agent(config, job), job, target


def set_log_level(level: str) -> None:
    logging.getLogger().setLevel(getattr(logging, level.upper(), logging.INFO))


def _describe(config: Config, gpu_lister: bool) -> str:
    w = config.watch
    rules = []
    if w.cmdline_regex:
        rules.append("command line matches watch.cmdline_regex")
    if w.env_markers:
        rules.append("environment has " + " or ".join(w.env_markers))
    if w.gpu_processes and gpu_lister:
        rules.append("holds a GPU context")
    text = "; ".join(rules) or "no rule (nothing will be watched)"
    if w.gpu_processes and not gpu_lister:
        text += " (GPU rule inactive: the gpu source is off or does not list PIDs)"
    return text


def _changed_fixed_keys(old: Config, new: Config) -> list[str]:
    out = []
    for key in all_keys():
        if key.section == "watch" or key.dotted in RELOADABLE:
            continue
        if getattr(old.section(key.section), key.name) != getattr(new.section(key.section), key.name):
            out.append(key.dotted)
    return out


# Under systemd (``Type=notify``) the daemon sends
# READY=1 once serving, WATCHDOG=1 every WatchdogSec/2 while the agent is healthy,
# RELOADING=1 and READY=1 around a SIGHUP reload, and STOPPING=1 on SIGTERM/SIGINT.
#
# The watchdog pings come from a thread of their own (``profagent-watchdog``) that does
# nothing else: no scan, capture, trace ingestion or reload runs on it, so none can delay
# a ping. "Healthy" means the runtime's target loop (discovery and the job trees) finished
# a refresh within the last WatchdogSec: a loop that is stuck, or that takes longer than
# that per refresh, stops the pings and systemd restarts the agent; a slow tick alone does
# not. The HTTP server and the sources run on their own threads and do not take part.
#
# SIGHUP re-reads the configuration (file, environment, the original flags) and applies
# what can change in place: the ``[watch]`` section (discovery rules, limits, grace, scan
# interval) and ``log_level``. Other keys (listen, sources) need a restart; a reload that
# changes them says so in the log. A configuration that fails to load is logged and the
# previous one is kept. Jobs already watched stay until they end, so no series drop.
class NodeDaemon:
    """Runs the agent until stopped; ``reload_config`` re-reads the configuration."""

    def __init__(
        self,
        config: Config,
        reload_config: Callable[[], Config],
        notifier: Notifier,
        console: Console,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._reload_config = reload_config
        self.notifier = notifier
        self.console = console
        self._clock = clock
        self.stop_event = threading.Event()
        self.reload_event = threading.Event()
        self.agent, self.job, self.target = build(config)

    def status(self) -> str:
        n = self.target.jobs_watched
        return f"watching {n} job{'s' if n != 1 else ''}; metrics on {self.agent.server.url}"

    def run(self) -> int:
        restore = self._install_signals()
        try:
            self.agent.start()
            self._banner()
            self.notifier.ready(self.status())
            self._loop()
        finally:
            self.notifier.stopping()
            self.agent.stop()
            restore()
        return 0

    def _loop(self) -> None:
        """The main thread: signals and reloads. The watchdog has a thread of its own."""
        watchdog = None
        if self.notifier.watchdog_interval:
            watchdog = threading.Thread(target=self._watchdog_loop, name="profagent-watchdog", daemon=True)
            watchdog.start()
        try:
            while not self.stop_event.wait(TICK):
                if self.reload_event.is_set():
                    self.reload_event.clear()
                    self.reload()
        finally:
            if watchdog is not None:
                watchdog.join(1.0)

    def healthy(self, now: float) -> bool:
        """Whether discovery finished a refresh within the last WatchdogSec."""
        interval = self.notifier.watchdog_interval or 0.0
        last = self.target.last_refresh
        return last is not None and now - last < 2 * interval

    def _watchdog_loop(self) -> None:
        """Ping every WatchdogSec/2 while healthy; only reads a timestamp, never waits on a lock."""
        interval = self.notifier.watchdog_interval
        if not interval:
            return
        while not self.stop_event.wait(interval):
            now = self._clock()
            if self.healthy(now):
                self.notifier.watchdog(self.status())
            else:
                last = self.target.last_refresh
                log.warning("discovery has not refreshed for %.0fs: not pinging the watchdog", now - (last or now))

    def reload(self) -> bool:
        """Apply a fresh configuration; keep the old one if it does not load."""
        self.notifier.reloading()
        try:
            try:
                new = self._reload_config()
            except UserError as exc:
                log.error("reload failed, keeping the previous configuration: %s", exc)
                return False
            self.target.reconfigure(Rules.from_config(new.watch), Limits.from_config(new.watch))
            self.target.set_gpu_pids(_gpu_pids(self.job) if new.watch.gpu_processes else None)
            set_log_level(new.agent.log_level)
            fixed = _changed_fixed_keys(self.config, new)
            if fixed:
                log.warning("reload: %s changed; restart profagent to apply", ", ".join(fixed))
            self.config = new
            log.info("configuration reloaded: %s", _describe(new, self.target.gpu_rule_active))
            return True
        finally:
            self.notifier.ready(self.status())

    def _install_signals(self) -> Callable[[], None]:
        handlers = {
            signal.SIGINT: lambda *_: self.stop_event.set(),
            signal.SIGTERM: lambda *_: self.stop_event.set(),
            signal.SIGHUP: lambda *_: self.reload_event.set(),
        }
        old = {sig: signal.getsignal(sig) for sig in handlers}
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

        def restore() -> None:
            for sig, handler in old.items():
                signal.signal(sig, handler)

        return restore

    def _banner(self) -> None:
        c = self.console
        w = self.config.watch
        c.print("[bold]profagent[/bold] watching this node for training jobs", highlight=False)
        banner_line(c, f"  discovery: {_describe(self.config, self.target.gpu_rule_active)}")
        banner_line(c, f"  limits: {w.max_jobs} jobs ({Limits.from_config(w).per_user} per user), "
                       f"{w.max_processes_per_job} processes per job; ended jobs kept {w.grace_seconds:g}s")
        view = self.job.state.view()
        for name, health in sorted(view.health.items()):
            state = "[green]on[/green]" if health.up else f"[yellow]off[/yellow]: {health.detail}"
            banner_line(c, f"  source {name}: {state}")
        for d in self.job.disabled:
            banner_line(c, f"  source {d.name}: [yellow]off[/yellow]: {d.why}")
        c.print(f"  metrics: {self.agent.server.url}", highlight=False)
        if self.notifier.address:
            c.print(f"  systemd: notify socket set, watchdog every {self.notifier.watchdog_interval or 0:g}s", highlight=False)


def watch(
    config: Config,
    reload_config: Callable[[], Config],
    console: Console,
    env: Mapping[str, str] | None = None,
) -> int:
    """What ``profagent watch`` runs: serve every job of the node until SIGTERM/SIGINT."""
    notifier = Notifier.from_env(os.environ if env is None else env)
    return NodeDaemon(config, reload_config, notifier, console).run()

"""Runtime: runs the target refresh and every source on its own interval, in isolation.

Each source gets a thread. A tick that raises is counted in
``profagent_collector_errors_total{collector,reason}`` and each distinct error is logged
once; the other sources go on. ``stop()`` returns within about two seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from profagent.contracts import ProcessTree
from profagent.errors import SourceError, SourceUnavailable, SourceWaiting, TargetGone, UserError
from profagent.logs import LogOnce
from profagent.sources import Source
from profagent.state import State
from profagent.system.cputime import CPU, CpuAccount
from profagent.target import PidTarget

log = logging.getLogger(__name__)


class Runtime:
    def __init__(
        self,
        target: PidTarget,
        sources: Sequence[Source],
        state: State,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        cpu: CpuAccount = CPU,
    ) -> None:
        self.target = target
        self._cpu = cpu
        self.sources = list(sources)
        self.state = state
        self.interval = interval
        self._clock = clock
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._log_once = LogOnce(log)
        self._gone_since: float | None = None
        self._hooks: list[tuple[str, Callable[[], None]]] = []

    def add_hook(self, name: str, hook: Callable[[], None]) -> None:
        """Call ``hook()`` after every target refresh, in the target thread (before start())."""
        self._hooks.append((name, hook))

    # -- lifecycle --------------------------------------------------------------
    def start(self) -> ProcessTree:
        """Resolve the tree once (so sources never see None), start every source (those
        that cannot run are turned off with their reason), then start every loop."""
        tree = self.target.refresh()
        self.state.set_tree(tree)
        self._spawn("target", self._target_loop)
        for source in self.sources:
            # Registered (collector_up 1) only once started: /metrics is served while the
            # sources start, and must not show one up that is about to be turned off.
            try:
                source.start()
            except SourceWaiting as exc:  # started, but off until what it waits for is free
                self.state.register(source.name)
                self.state.set_waiting(source.name, str(exc), exc.why)
                self._spawn(source.name, lambda s=source: self._source_loop(s))
                continue
            except SourceUnavailable as exc:
                self._off(source, str(exc), at_start=True, not_applicable=getattr(exc, "why", ""))
                continue
            except UserError:
                raise  # a source that refuses the agent's start: one line, exit 2
            except Exception as exc:
                self._off(source, f"{source.name} source failed to start: {exc}", at_start=True)
                continue
            self.state.register(source.name)
            self._spawn(source.name, lambda s=source: self._source_loop(s))
        return tree

    def stop(self, timeout: float = 1.5) -> None:
        """Stop every source at once, each in a daemon thread, and wait for them and the
        loops until one shared deadline: one by one, their one-second joins added up."""
        self._stop.set()
        deadline = self._clock() + timeout
        stoppers = [threading.Thread(target=self._stop_source, args=(s,), name=f"profagent-stop-{s.name}", daemon=True)
                    for s in self.sources]
        for thread in stoppers:
            thread.start()
        for thread in [*stoppers, *self._threads]:
            thread.join(max(0.0, deadline - self._clock()))
        late = [t.name for t in [*stoppers, *self._threads] if t.is_alive()]
        if late:
            log.debug("still running after %.1f s of stopping (left to exit with the process): %s", timeout, ", ".join(late))

    @staticmethod
    def _stop_source(source: Source) -> None:
        try:
            source.stop()
        except Exception as exc:  # stopping must go on for the others
            log.warning("stopping %s failed: %s", source.name, exc)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep until stopped or ``seconds`` pass; True if stopped."""
        return self._stop.wait(seconds)

    def target_gone_for(self) -> float:
        """Seconds since the whole tree vanished (0 while it is alive)."""
        return 0.0 if self._gone_since is None else self._clock() - self._gone_since

    # -- loops -------------------------------------------------------------------
    def _spawn(self, name: str, fn: Callable[[], None]) -> None:
        thread = threading.Thread(target=fn, name=f"profagent-{name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _target_loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                with self._cpu.charge("target"):
                    tree = self.target.refresh()
            except Exception as exc:  # psutil races; keep the last tree
                message = f"refreshing the process tree failed: {exc}"
                self._log_once(logging.WARNING, ("target", message), message)
                continue
            self.state.set_tree(tree)
            if tree.alive:
                self._gone_since = None
            elif self._gone_since is None:
                self._gone_since = self._clock()
            self._run_hooks()

    def _run_hooks(self) -> None:
        for name, hook in self._hooks:
            try:
                with self._cpu.charge(name):
                    hook()
            except Exception as exc:  # a failing hook never stops the target refresh
                reason = type(exc).__name__
                self.state.record_error(name, reason)
                self._log_once(logging.WARNING, name, f"{name}: unexpected {reason}: {exc}")
                log.debug("%s hook failed", name, exc_info=True)

    def _source_loop(self, source: Source) -> None:
        name = source.name
        while not self._stop.is_set():
            began = self._clock()
            tree = self.state.tree
            try:
                if tree is not None and tree.alive:
                    with self._cpu.charge(name):  # publishing encodes the snapshot: part of its cost
                        snapshot = source.collect(tree)
                        self.state.publish(name, snapshot, self._clock() - began)
            except TargetGone:
                self.state.record_error(name, TargetGone.reason, self._clock() - began)
            except SourceWaiting as exc:  # the source said why in its own one line
                self.state.set_waiting(name, str(exc), exc.why)
            except SourceUnavailable as exc:
                self._off(source, str(exc), not_applicable=getattr(exc, "why", ""))
                return
            except SourceError as exc:
                self.state.record_error(name, exc.reason, self._clock() - began)
                message = f"{name}: {exc}"
                self._log_once(logging.WARNING, (name, message), message)
            except Exception as exc:
                reason = type(exc).__name__
                self.state.record_error(name, reason, self._clock() - began)
                message = f"{name}: unexpected {reason}: {exc}"
                self._log_once(logging.WARNING, (name, message), message)
                log.debug("%s tick failed", name, exc_info=True)
            self._stop.wait(max(0.0, source.interval - (self._clock() - began)))

    def _off(self, source: Source, detail: str, at_start: bool = False, not_applicable: str = "") -> None:
        self.state.set_down(source.name, detail, not_applicable)
        self.state.record_error(source.name, SourceUnavailable.reason)
        # At start the banner shows the reason; a source lost later is worth a warning.
        self._log_once(logging.DEBUG if at_start else logging.WARNING, (source.name, detail), detail)
        try:
            source.stop()
        except Exception:
            log.debug("stop after failure of %s", source.name, exc_info=True)

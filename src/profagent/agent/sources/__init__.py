"""Sources: one module per kind of observation, all behind one small protocol.

A source is started once, asked to ``collect`` on its own interval with the latest
process tree, and stopped once. ``collect`` returns an immutable snapshot that the
runtime publishes into the state; it never touches the exporter.

Sources raise only the project errors below. Anything else that escapes is caught by
the runtime, counted under its exception type, and logged once.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from profagent.agent.target import ProcessTree


class SourceError(Exception):
    """A failed tick. ``reason`` is a short, bounded label for collector_errors_total."""

    reason = "error"

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        if reason:
            self.reason = reason


class SourceUnavailable(SourceError):
    """The source cannot run here (no driver, ptrace denied...). The message is one line
    naming the problem and the fix; the source is turned off and the others go on."""

    reason = "unavailable"


class TargetGone(SourceError):
    """The process being observed exited during the tick. Not an error worth logging."""

    reason = "target_gone"


@runtime_checkable
class Source(Protocol):
    name: str  # the `collector` label: host, gpu, stacks, traces, ondemand
    interval: float

    def start(self) -> None:
        """Prepare. Raise SourceUnavailable to turn the source off with a reason."""

    def collect(self, tree: ProcessTree) -> Any:
        """One tick: return an immutable snapshot of what was observed."""

    def stop(self) -> None:
        """Release everything (children, handles). Must return within about a second."""

"""Sources: one module per kind of observation, all behind one small protocol.

A source is started once, asked to ``collect`` on its own interval with the latest
process tree, and stopped once. ``collect`` returns an immutable snapshot that the
runtime publishes into the state; it never touches the exporter.

Sources raise only the project errors of ``profagent.errors`` (SourceError,
SourceUnavailable, TargetGone). Anything else that escapes is caught by
the runtime, counted under its exception type, and logged once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # annotation only: importing a reader must not pull in psutil
    from profagent.contracts import ProcessTree


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

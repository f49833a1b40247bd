"""State: the latest immutable snapshot of every source, and each source's health.

Sources publish; exporters read a consistent copy (``view()``) and never wait on a
source: the lock is held only to swap references.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from profagent.contracts import ProcessTree, SourceHealth, StateView


class State:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._tree: ProcessTree | None = None
        self._snapshots: dict[str, Any] = {}
        self._health: dict[str, SourceHealth] = {}
        self._listeners: list[Callable[[str, Any], None]] = []

    def register(self, name: str) -> None:
        with self._lock:
            self._health.setdefault(name, SourceHealth())

    def set_tree(self, tree: ProcessTree) -> None:
        with self._lock:
            self._tree = tree

    @property
    def tree(self) -> ProcessTree | None:
        return self._tree

    def publish(self, name: str, snapshot: Any, duration: float) -> None:
        with self._lock:
            self._snapshots[name] = snapshot
            old = self._health.get(name, SourceHealth())
            self._health[name] = replace(
                old, up=True, detail="", retrying="", last_duration=duration, last_success=self._clock()
            )
            listeners = list(self._listeners)
        for listener in listeners:  # outside the lock: e.g. the exporter encoding the snapshot
            listener(name, snapshot)

    def subscribe(self, listener: Callable[[str, Any], None]) -> None:
        """Call ``listener(name, snapshot)`` in the publishing thread after each publish."""
        with self._lock:
            self._listeners.append(listener)

    def record_error(self, name: str, reason: str, duration: float | None = None) -> None:
        with self._lock:
            old = self._health.get(name, SourceHealth())
            errors = dict(old.errors)
            errors[reason] = errors.get(reason, 0) + 1
            self._health[name] = replace(
                old, errors=errors, last_duration=duration if duration is not None else old.last_duration
            )

    def set_down(self, name: str, detail: str, not_applicable: str = "") -> None:
        """The source is off (unavailable or stopped for good); its last snapshot is dropped.
        ``not_applicable`` says why it has nothing to do on this node (not a fault)."""
        with self._lock:
            old = self._health.get(name, SourceHealth())
            self._health[name] = replace(old, up=False, detail=detail, not_applicable=not_applicable)
            self._snapshots.pop(name, None)

    def set_waiting(self, name: str, detail: str, why: str) -> None:
        """The source is off for now and retries by itself (``why``: a closed code); its next
        published snapshot turns it on again."""
        with self._lock:
            old = self._health.get(name, SourceHealth())
            self._health[name] = replace(old, up=False, detail=detail, not_applicable="", retrying=why)
            self._snapshots.pop(name, None)

    def view(self) -> StateView:
        with self._lock:
            return StateView.of(self._snapshots, self._tree, self._health)

"""Log a line once: a failing tick or a recurring condition must not flood the log."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable


class LogOnce:
    """Logs each key's first message only; ``forget`` lets a key log again later."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._seen: set[Hashable] = set()
        self._lock = threading.Lock()

    def __call__(self, level: int, key: Hashable, message: str, *args: object) -> bool:
        """Log ``message % args`` at ``level`` unless ``key`` already logged. True if logged."""
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
        self._logger.log(level, message, *args)
        return True

    def forget(self, keep: Callable[[Hashable], bool]) -> None:
        """Drop the keys ``keep`` rejects (e.g. jobs that ended), so they may log again."""
        with self._lock:
            self._seen = {key for key in self._seen if keep(key)}

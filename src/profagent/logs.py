"""Log lines that stay lines: one message per line, escaped, and each at most once.

- ``PrintableFormatter``: every log line of profagent goes through it. Messages carry
  names from the watched jobs (job ids, ranks, paths, function names), so a newline in
  ``SLURM_JOB_ID`` would start a forged log line and an ESC would drive the reader's
  terminal: control characters are written as visible escapes (``\\x0a``, ``\\x1b``).
- ``LogOnce``: a failing tick or a recurring condition must not flood the log.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable

from profagent.labels import printable

LINE_INDENT = "    "  # continuation lines: indented, so none can pass for a record of its own


class PrintableFormatter(logging.Formatter):
    """A ``logging.Formatter`` whose message is one line with no control character; a
    traceback keeps its line breaks, nothing else. A record with ``extra={"lines": [...]}``
    (a stack, one frame a line) gets each of them on a line of its own, indented and escaped."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = printable(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        lines = getattr(record, "lines", None)
        if isinstance(lines, (list, tuple)) and lines:
            text += "".join(f"\n{LINE_INDENT}{printable(str(line))}" for line in lines)
        return text

    def formatException(self, ei) -> str:  # type: ignore[no-untyped-def]  # noqa: N802
        return printable(super().formatException(ei), keep_newlines=True)


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

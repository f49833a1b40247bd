"""Log lines that stay lines: one message per line, escaped, and each at most once.

- ``PrintableFormatter``: every log line of profagent goes through it. Messages carry
  names from the watched jobs (job ids, ranks, paths, function names), so a newline in
  ``SLURM_JOB_ID`` would start a forged log line and an ESC would drive the reader's
  terminal: control characters are written as visible escapes (``\\x0a``, ``\\x1b``).
- Timestamps: a line starts with the time it was logged, RFC 3339 in UTC with
  milliseconds (``2026-11-28T12:00:00.123Z``), as ``kubectl logs --timestamps`` and log
  shippers read it, unless stderr is connected to journald (``JOURNAL_STREAM`` names
  stderr's device and inode, as systemd documents), which stamps every line itself.
- ``LogOnce``: a failing tick or a recurring condition must not flood the log.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Mapping

from profagent.labels import printable


def rfc3339(when: float) -> str:
    """``when`` (Unix time) as RFC 3339 in UTC with milliseconds: ``2026-11-28T12:00:00.123Z``."""
    millis = int(when * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(millis // 1000)) + f".{millis % 1000:03d}Z"


def stderr_is_journal(environ: Mapping[str, str] = os.environ, fd: int = 2) -> bool:
    """Whether ``fd`` is the stream systemd connected to journald: ``JOURNAL_STREAM`` is
    "DEVICE:INODE" of that stream, and still names ``fd`` (not a pipe it was redirected to)."""
    device, sep, inode = environ.get("JOURNAL_STREAM", "").partition(":")
    if not sep or not device.isdigit() or not inode.isdigit():
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (int(device), int(inode))


class PrintableFormatter(logging.Formatter):
    """A ``logging.Formatter`` whose message is one line with no control character; a
    traceback keeps its line breaks, nothing else. With ``timestamps``, each line starts
    with the record's time (``rfc3339``)."""

    def __init__(self, fmt: str | None = None, *, timestamps: bool = False) -> None:
        super().__init__(fmt)
        self.timestamps = timestamps

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        return f"{rfc3339(record.created)} {line}" if self.timestamps else line

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = printable(record.message)
        return super().formatMessage(record)

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

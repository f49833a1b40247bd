"""Log lines that stay lines: one message per line, escaped, stamped, and each at most once.

Messages carry names from the watched jobs, so every line is escaped (``PrintableFormatter``);
floods are cut (``LogOnce``, ``RateLimit``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Mapping

from profagent.labels import printable

LINE_INDENT = "    "  # continuation lines: indented, so none can pass for a record of its own


# - ``PrintableFormatter``: every log line of profagent goes through it. Messages carry
#   names from the watched jobs (job ids, ranks, paths, function names), so a newline in
#   ``SLURM_JOB_ID`` would start a forged log line and an ESC would drive the reader's
#   terminal: control characters are written as visible escapes (``\x0a``, ``\x1b``).
# - Timestamps: a line starts with the time it was logged, RFC 3339 in UTC with
#   milliseconds (``2026-11-28T12:00:00.123Z``), as ``kubectl logs --timestamps`` and log
#   shippers read it, unless stderr is connected to journald (``JOURNAL_STREAM`` names
#   stderr's device and inode, as systemd documents), which stamps every line itself.
# - ``LogOnce``: a failing tick or a recurring condition must not flood the log.
# - ``RateLimit``: and whatever slips through, at most 10 lines per message kind a minute,
#   the number held back said by the kind's next line.
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
    traceback keeps its line breaks, nothing else. A record with ``extra={"lines": [...]}``
    (a stack, one frame a line) gets each of them on a line of its own, indented and escaped.
    With ``timestamps``, each line starts with the record's time (``rfc3339``)."""

    def __init__(self, fmt: str | None = None, *, timestamps: bool = False) -> None:
        super().__init__(fmt)
        self.timestamps = timestamps

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = printable(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if self.timestamps:  # the record's first line; continuation lines stay indented under it
            text = f"{rfc3339(record.created)} {text}"
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


class RateLimit(logging.Filter):
    """At most ``burst`` lines per message kind (logger, level and format string: "ignoring
    job %s (PID %d)" is one kind whatever the job) every ``window`` seconds. What is held
    back is counted, and the kind's next line says how many were suppressed. A neighbour
    who starts 3,000 look-alike processes cannot fill root's journal. DEBUG lines (asked
    for) pass."""

    def __init__(self, burst: int = 10, window: float = 60.0, clock: Callable[[], float] | None = None) -> None:
        super().__init__()
        import time

        self.burst, self.window = burst, window
        self._clock = clock or time.monotonic
        self._kinds: dict[tuple[str, int, str], list[float]] = {}  # kind -> [window start, lines, suppressed]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.DEBUG:
            return True
        kind = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        with self._lock:
            state = self._kinds.get(kind)
            if state is None or now - state[0] >= self.window:
                suppressed = int(state[2]) if state is not None else 0
                self._kinds[kind] = [now, 1, 0]
                if len(self._kinds) > MAX_KINDS:  # kinds are format strings of the code: few; bounded anyway
                    oldest = min(self._kinds, key=lambda k: self._kinds[k][0])
                    del self._kinds[oldest]
            elif state[1] < self.burst:
                state[1] += 1
                suppressed = 0
            else:
                state[2] += 1
                return False
        if suppressed:
            record.msg = f"{record.getMessage()} ({suppressed} more like it suppressed in the last {self.window:.0f} s)"
            record.args = None
        return True


MAX_KINDS = 4096

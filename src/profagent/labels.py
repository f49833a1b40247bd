"""Bounded label values: one "…" truncation, one hashed bound and one top-K + "other" fold.

Free-form names (functions, kernels, ops, command lines) become Prometheus label values
here, so their number and length stay bounded wherever they come from.

Identities taken from outside (environment values: job ids, ranks, Slurm and pod names)
are bounded by ``bound`` where they enter the agent (``system/procfs.read_environ``), so no
series, log line or finding ever holds more than ``agent.max_label_bytes`` of them. A
longer value keeps its start and gets a hash of the whole, so two distinct long job ids
stay two jobs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

OTHER = "other"
ELLIPSIS = "…"
LABEL_MAX = 120  # characters of a free-form label value
VALUE_MAX = 128  # bytes of an identity from outside (agent.max_label_bytes)
VALUE_MIN = 32  # room for a start, the "…" and the hash
_HASH_CHARS = 12  # hex digits of sha256: 48 bits, distinct for any realistic number of values
_value_max = VALUE_MAX


def set_value_max(limit: int) -> None:
    """The bound of ``bound`` (agent.max_label_bytes), set once at start-up."""
    global _value_max
    _value_max = max(VALUE_MIN, limit)


def value_max() -> int:
    return _value_max


def bound(text: str, limit: int | None = None) -> str:
    """``text`` if it is at most ``limit`` bytes of UTF-8, else its start, "…" and a hash of
    the whole value (``limit`` bytes in all), so distinct values stay distinct."""
    limit = _value_max if limit is None else max(VALUE_MIN, limit)
    if len(text) * 4 <= limit:
        return text  # fits whatever the characters
    raw = text.encode("utf-8", "surrogateescape")
    if len(raw) <= limit:
        return text
    import hashlib  # only for a value too long (hashlib's import is 3 ms of `profagent analyze`)

    digest = hashlib.sha256(raw).hexdigest()[:_HASH_CHARS]
    keep = limit - len(ELLIPSIS.encode()) - _HASH_CHARS
    start = raw[:keep].decode("utf-8", "ignore")  # a character cut in two is dropped
    return f"{start}{ELLIPSIS}{digest}"


def shorten(text: str, limit: int = LABEL_MAX) -> str:
    """``text`` if it fits in ``limit`` characters, else its start and "…" (``limit`` in all)."""
    return text if len(text) <= limit else text[: limit - 1] + ELLIPSIS


def fold_top_k(rows: Iterable[tuple[str, float]], k: int, limit: int = LABEL_MAX) -> dict[str, float]:
    """The first ``k`` rows by name (shortened; names equal once shortened are merged), the
    rest summed under "other". ``rows`` come ranked, largest first."""
    out: dict[str, float] = {}
    for i, (name, value) in enumerate(rows):
        key = OTHER if i >= k else shorten(name, limit)
        out[key] = out.get(key, 0.0) + value
    return out


# C0 (but space), DEL, C1, the Unicode line and paragraph separators and the bidi
# overrides: what a terminal or a log reader would act on rather than show.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_UNPRINTABLE_BUT_NEWLINE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, keep_newlines: bool = False) -> str:
    """``text`` safe for a terminal or a log line: every control character (ESC, CR, LF,
    C1...) written as a visible escape (``\\x1b``), so it is shown, never obeyed. Names from
    outside (ranks, job ids, functions, kernels, paths) pass here before any output.
    ``keep_newlines``: a multi-line text of the agent's own keeps its line breaks."""
    pattern = _UNPRINTABLE_BUT_NEWLINE if keep_newlines else _UNPRINTABLE
    return pattern.sub(_escaped, text)


def printable_data(value: Any) -> Any:
    """``printable`` applied to every string (keys included) of decoded JSON."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_data(k): printable_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [printable_data(v) for v in value]
    return value

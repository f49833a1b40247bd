"""Bounded label values: one "…" truncation and one top-K + "other" fold.

Free-form names (functions, kernels, ops, command lines) become Prometheus label values
here, so their number and length stay bounded wherever they come from.
"""

from __future__ import annotations

from collections.abc import Iterable

OTHER = "other"
ELLIPSIS = "…"
LABEL_MAX = 120  # characters of a free-form label value


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

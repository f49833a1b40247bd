"""Reading a dashboard model: its panels, their PromQL targets, the metrics they name.

Pure functions over the JSON model (no SDK), shared by the tests and by anything that
wants to check a dashboard against a live exposition.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

# PromQL words that look like metric names but are not.
_KEYWORDS = frozenset({
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
    "offset", "inf", "nan",
    # aggregations, which may be followed by `by (...)` rather than their parenthesis
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
    "bottomk", "topk", "quantile",
})
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACES = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_DOLLAR = re.compile(r"\$\{?[a-zA-Z_]+\}?")
_NUMBER = re.compile(r"(?<![a-zA-Z0-9_:])\d[a-zA-Z0-9_.]*")  # 0.05, 1e9, 3600, 30m


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str  # uid
    panel: str  # title
    ref_id: str
    expr: str
    instant: bool


def iter_panels(model: dict) -> Iterator[dict]:
    """Every panel, rows' nested panels included (rows themselves too)."""
    for panel in model.get("panels") or []:
        yield panel
        yield from iter_panels(panel)


def iter_targets(model: dict) -> Iterator[PanelQuery]:
    for panel in iter_panels(model):
        for t in panel.get("targets") or []:
            if t.get("expr"):
                yield PanelQuery(model["uid"], panel.get("title", ""), t.get("refId", ""), t["expr"], bool(t.get("instant")))


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (functions and label names left out)."""
    text = _STRING.sub('""', expr)
    text = _BRACES.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _DOLLAR.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        word = m.group(0)
        rest = text[m.end():].lstrip()
        if word in _KEYWORDS or rest.startswith("("):
            continue  # a function call or an aggregation
        before = text[: m.start()].rstrip()
        if before.endswith(("by (", "on (", "ignoring (", "without (", "group_left (", "group_right (")) or _in_label_list(text, m.start()):
            continue
        names.add(word)
    return names


def _in_label_list(text: str, pos: int) -> bool:
    """True inside the parentheses of by/without/on/ignoring/group_left/group_right."""
    depth = 0
    i = pos - 1
    while i >= 0:
        c = text[i]
        if c == ")":
            depth += 1
        elif c == "(":
            if depth == 0:
                head = text[:i].rstrip()
                return head.endswith(("by", "without", "on", "ignoring", "group_left", "group_right"))
            depth -= 1
        i -= 1
    return False

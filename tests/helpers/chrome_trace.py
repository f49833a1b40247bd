"""A checker of the Trace Event Format (Chrome's JSON traces, which Perfetto UI and
chrome://tracing open), written from its documented fields, independent of the code that
writes the timeline picture; and readers of the picture's tracks."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

PHASES = set("BEXiIbneCsftPOND") | {"M", "R", "c", "(", ")", "S", "T", "F", "p", "V", "v"}
METADATA = {"process_name": "name", "process_labels": "labels", "process_sort_index": "sort_index",
            "thread_name": "name", "thread_sort_index": "sort_index"}
NEST_SLACK_US = 0.01  # ts and dur are rounded to the nanosecond


def check(doc: Any) -> list[str]:
    """Every way ``doc`` breaks the format (empty when it holds): the JSON Object Format (a
    ``traceEvents`` list; ``displayTimeUnit`` ms or ns), each event's required fields for its
    phase, and complete events of one thread nested as the viewers need them."""
    problems: list[str] = []
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["not a JSON object with a traceEvents list"]
    if doc.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        problems.append(f"displayTimeUnit {doc['displayTimeUnit']!r}")
    if "otherData" in doc and not isinstance(doc["otherData"], dict):
        problems.append("otherData is not an object")
    slices: dict[tuple[int, int], list[tuple[float, float, str]]] = defaultdict(list)
    for i, e in enumerate(doc["traceEvents"]):
        where = f"event {i} ({e.get('name') if isinstance(e, dict) else e!r})"
        if not isinstance(e, dict):
            problems.append(f"{where}: not an object")
            continue
        ph = e.get("ph")
        if ph not in PHASES:
            problems.append(f"{where}: phase {ph!r}")
            continue
        if not isinstance(e.get("name"), str):
            problems.append(f"{where}: no name")
        for key in ("pid", "tid"):
            if not isinstance(e.get(key), int) or isinstance(e.get(key), bool):
                problems.append(f"{where}: {key} is not an integer")
        if "args" in e and not isinstance(e["args"], dict):
            problems.append(f"{where}: args is not an object")
        if "cat" in e and not isinstance(e["cat"], str):
            problems.append(f"{where}: cat is not a string")
        if ph == "M":
            field = METADATA.get(e.get("name", ""))
            if field is None or not isinstance(e.get("args"), dict) or field not in e["args"]:
                problems.append(f"{where}: metadata without its args.{field}")
            continue
        if not _number(e.get("ts")):
            problems.append(f"{where}: ts is not a number")
            continue
        if ph == "X":
            if not _number(e.get("dur")) or e["dur"] < 0:
                problems.append(f"{where}: complete event without a duration")
                continue
            slices[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        if ph in ("i", "I") and e.get("s", "t") not in ("g", "p", "t"):
            problems.append(f"{where}: instant scope {e.get('s')!r}")
    for (pid, tid), spans in slices.items():
        open_: list[tuple[float, float, str]] = []
        for begin, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ and open_[-1][1] <= begin + NEST_SLACK_US:
                open_.pop()
            if open_ and end > open_[-1][1] + NEST_SLACK_US:
                problems.append(f"pid {pid} tid {tid}: {name!r} at {begin} overlaps {open_[-1][2]!r} without nesting")
            open_.append((begin, end, name))
    return problems


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def tracks(doc: dict) -> dict[str, tuple[int, int]]:
    """Thread name -> (pid, tid)."""
    return {e["args"]["name"]: (e["pid"], e["tid"]) for e in doc["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def processes(doc: dict) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}


def events(doc: dict, track: tuple[int, int], ph: str | None = None, cat: str | None = None) -> list[dict]:
    """The events of one track, in time order."""
    return sorted((e for e in doc["traceEvents"] if (e["pid"], e["tid"]) == track and e["ph"] != "M"
                   and (ph is None or e["ph"] == ph) and (cat is None or e.get("cat") == cat)), key=lambda e: e["ts"])


def rank_track(doc: dict, rank: int | str) -> tuple[int, int]:
    return next(v for k, v in tracks(doc).items() if k.startswith(f"rank {rank} "))

"""One incident bundle on disk: its file names and its typed metadata (``incident.json``).

``BundleMeta`` is the one place that writes and reads ``incident.json``: a new field of the
bundle is one dataclass field here. Reading is strict about types and lenient about
absence: a value of the wrong type (a bundle written by hand, or by another version) reads
as absent, never as data of another shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from profagent.system.safefs import read_nofollow

META = "incident.json"
SUMMARY = "summary.md"
FINDINGS = "findings.json"
TIMELINE = "timeline.json"  # the picture of every rank's steps before the trigger (docs/timeline.md)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")

# the keys of a bundle that GET /api/incidents and `incidents list` show (docs/openapi.yaml)
LISTED = ("id", "kind", "job_id", "time", "path", "rank", "reason", "status")


def safe_name(text: str, default: str = "unknown") -> str:
    """``text`` usable in a file name: anything but letters, digits, ``_.-`` becomes ``_``."""
    return _UNSAFE.sub("_", text) or default


def stacks_file(rank: str) -> str:
    return f"stacks-rank{safe_name(rank)}.txt"


def worker_stacks_file(rank: str, pid: int) -> str:
    return f"stacks-rank{safe_name(rank)}-worker{pid}.txt"


def trace_analysis_file(rank: str) -> str:
    return f"trace-analysis-rank{safe_name(rank)}.json"


def trace_file(rank: str) -> str:
    return f"trace-rank{safe_name(rank)}.pt.trace.json.gz"


def to_json(data: Any) -> bytes:
    """How every JSON file of a bundle is written: indented, one final newline."""
    return json.dumps(data, indent=2, default=str).encode() + b"\n"


@dataclass
class BundleMeta:
    """``incident.json``. A field left None is not written. ``path`` is where the bundle was
    found when read (never written: the folder is the truth)."""

    id: str
    kind: str | None = None  # hang, regression, manual
    job_id: str | None = None
    time: float | None = None  # when the trigger fired (Unix seconds)
    rank: str | None = None  # the rank the trigger names
    reason: str | None = None  # the trigger's one line, as it is now
    uid: int | None = None  # the real uid of the job's processes (retention per user)
    status: str | None = None  # capturing, then complete
    completed: float | None = None
    updated: float | None = None  # when the trigger last changed while the bundle was open
    first_reason: str | None = None  # the trigger's line when the bundle was captured, once it changed
    files: list[str] | None = None  # the bundle's files once complete
    notes: list[str] | None = None  # what could not be captured, and why (also in the summary)
    path: str | None = dataclasses.field(default=None, compare=False)

    def to_bytes(self) -> bytes:
        return to_json({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                        if f.name != "path" and getattr(self, f.name) is not None})

    def listed(self) -> dict[str, Any]:
        """The keys shown by GET /api/incidents and `incidents list`, None where absent."""
        return {k: getattr(self, k) for k in LISTED}

    def detail(self) -> dict[str, Any]:
        """The summary text and the files (name, bytes) of the bundle found at ``path``:
        GET /api/incidents?id=ID and `incidents show` add them to ``listed()``."""
        folder = Path(self.path or "")
        try:
            summary = read_nofollow(folder / SUMMARY).decode(errors="replace")
        except OSError:
            summary = ""
        files = []
        with contextlib.suppress(OSError):
            for entry in sorted(os.scandir(folder), key=lambda e: e.name):
                if entry.is_file(follow_symlinks=False) and not entry.name.startswith("."):
                    files.append({"name": entry.name, "bytes": entry.stat(follow_symlinks=False).st_size})
        return {"summary": summary, "files": files}

    @classmethod
    def from_json(cls, data: Any, path: str | None = None) -> BundleMeta | None:
        """The metadata in ``data`` (a parsed incident.json), None without a string ``id``."""
        if not isinstance(data, dict) or not isinstance(data.get("id"), str):
            return None
        values: dict[str, Any] = {"id": data["id"], "path": path}
        for f in dataclasses.fields(cls):
            if f.name in ("id", "path") or f.name not in data:
                continue
            value = data[f.name]
            kind = _FIELD_KINDS[f.name]
            if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
                values[f.name] = float(value)
            elif kind is int and isinstance(value, int) and not isinstance(value, bool) or kind is str and isinstance(value, str):
                values[f.name] = value
            elif kind is list and isinstance(value, list):
                values[f.name] = [str(v) for v in value]
        return cls(**values)

    @classmethod
    def read(cls, folder: Path) -> BundleMeta | None:
        """The bundle's metadata, None when it cannot be read or its id is not the folder's
        name. OSError and ValueError are the caller's to skip."""
        meta = cls.from_json(json.loads(read_nofollow(folder / META)), str(folder))
        return meta if meta is not None and meta.id == folder.name else None


def _kind(hint: Any) -> Any:
    """``str`` of ``str | None``, ``list`` of ``list[str] | None``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return typing.get_origin(args[0]) or args[0]


# what each field must hold when read, from its annotation: a new field needs nothing more
_FIELD_KINDS = {name: _kind(hint) for name, hint in typing.get_type_hints(BundleMeta).items()}

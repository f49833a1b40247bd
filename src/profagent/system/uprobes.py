"""Uprobe events in tracefs: define, remove, and clear what a dead agent left.

A definition alone costs a target nothing: the kernel places the breakpoint only while
an event is open (``perfevents.TracepointReader``), so an agent killed with SIGKILL
leaves inert definitions, which the next agent removes at its start. Every group is
``profagent_<token>``: one agent's own, never another tool's.

tracefs rejects seeks, so it is written with os.write, one command per call.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import subprocess
from pathlib import Path

TRACEFS_PATHS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
GROUP_PREFIX = "profagent_"
_DEFINITION = re.compile(r"^[pr]:(profagent_[0-9a-f]{1,32})/([A-Za-z0-9_]{1,64}) ")
MOUNT_TIMEOUT = 5.0


def find_tracefs(mount_if_missing: bool = False) -> Path | None:
    """The tracefs folder with uprobe_events; mounts tracefs at /sys/kernel/tracing when
    asked and it is missing (root only; harmless if it is there already)."""
    for path in TRACEFS_PATHS:
        if (path / "uprobe_events").exists():
            return path
    if mount_if_missing and TRACEFS_PATHS[0].is_dir():
        try:
            subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS_PATHS[0])], capture_output=True,
                           timeout=MOUNT_TIMEOUT, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        if (TRACEFS_PATHS[0] / "uprobe_events").exists():
            return TRACEFS_PATHS[0]
    return None


def new_group() -> str:
    return GROUP_PREFIX + secrets.token_hex(6)


def _write(tracefs: Path, line: str) -> None:
    fd = os.open(tracefs / "uprobe_events", os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def define(tracefs: Path, group: str, name: str, path: str, offset: int, fetchargs: str = "") -> int:
    """Define ``p:group/name path:offset fetchargs``; return its tracepoint id. Raises
    OSError (EINVAL with the kernel's reason in tracefs/error_log)."""
    if any(c.isspace() for c in path):
        raise OSError(errno.EINVAL, f"a path with white space cannot be probed: {path!r}")
    line = f"p:{group}/{name} {path}:{offset:#x}"
    _write(tracefs, f"{line} {fetchargs}".rstrip())
    return int((tracefs / "events" / group / name / "id").read_text().strip())


def remove(tracefs: Path, group: str, name: str) -> bool:
    """Remove one definition; False when it is still open somewhere (EBUSY) or gone."""
    try:
        _write(tracefs, f"-:{group}/{name}")
    except OSError:
        return False
    return True


def definitions(tracefs: Path) -> list[tuple[str, str]]:
    """(group, name) of every profagent definition in uprobe_events."""
    try:
        text = (tracefs / "uprobe_events").read_text(errors="replace")
    except OSError:
        return []
    return [(m.group(1), m.group(2)) for m in map(_DEFINITION.match, text.splitlines()) if m]


def remove_stale(tracefs: Path, keep: str = "") -> int:
    """Remove every profagent definition no agent has open (the kernel refuses to remove
    one in use, so a live agent's stay); ``keep`` is our own group. Returns how many."""
    removed = 0
    for group, name in definitions(tracefs):
        if group != keep and remove(tracefs, group, name):
            removed += 1
    return removed

"""Uprobe events in tracefs: define, remove, and clear what a dead agent left.

A definition alone costs a target nothing: the kernel places the breakpoint only while
an event is open (``perfevents.TracepointReader``), so an agent killed with SIGKILL
leaves inert definitions, which the next agent removes at its start. Every group is
``profagent_<pid namespace>_<pid>_<start time>_<serial>`` (hex): one agent's own, named so
that a later agent can prove it dead (``remove_stale``), never by a name's prefix alone.

tracefs rejects seeks, so it is written with os.write, one command per call.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
import subprocess
from pathlib import Path

TRACEFS_PATHS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
GROUP_PREFIX = "profagent_"
_DEFINITION = re.compile(r"^[pr]:(profagent_[A-Za-z0-9_]{1,54})/([A-Za-z0-9_]{1,64}) ")
# an agent's group: its PID namespace's inode, its pid there, its start time (clock ticks
# after boot, /proc/PID/stat field 22) and a serial within the process, all hex
_AGENT_GROUP = re.compile(r"^profagent_([0-9a-f]{1,16})_([0-9a-f]{1,8})_([0-9a-f]{1,16})_([0-9a-f]{1,4})$")
PROC_PID_INIT_INO = 0xEFFFFFFC  # the initial PID namespace's inode: every process is visible from it
_serial = itertools.count()
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


def new_group(proc_root: Path = Path("/proc")) -> str:
    """A group name of our own: it says which process made it, so that a later agent
    can tell whether that process still runs."""
    pid = os.getpid()
    start = _start_time(proc_root, pid)
    namespace = _pid_namespace(proc_root / "self")
    if start is None or namespace is None:
        raise OSError(errno.ENOENT, f"cannot read {proc_root}/self: needed to name our probe group")
    return group_name(namespace, pid, start, next(_serial) & 0xFFFF)


def group_name(namespace: int, pid: int, start: int, serial: int = 0) -> str:
    return f"{GROUP_PREFIX}{namespace:x}_{pid:x}_{start:x}_{serial:x}"


def _start_time(proc_root: Path, pid: int) -> int | None:
    try:
        text = (proc_root / str(pid) / "stat").read_bytes()
        return int(text[text.rindex(b")") + 2:].split()[19])  # field 22; the name may hold anything
    except (OSError, ValueError, IndexError):
        return None


def _pid_namespace(process: Path) -> int | None:
    try:
        return os.stat(process / "ns" / "pid").st_ino
    except OSError:
        return None


def _namespaces_in_use(proc_root: Path) -> set[int] | None:
    """The PID namespaces of every visible process; None when /proc cannot be listed."""
    out: set[int] = set()
    try:
        with os.scandir(proc_root) as entries:
            for entry in entries:
                if entry.name.isdigit() and (namespace := _pid_namespace(Path(entry.path))) is not None:
                    out.add(namespace)
    except OSError:
        return None
    return out


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


def dead_groups(groups: set[str], proc_root: Path = Path("/proc"), initial: int = PROC_PID_INIT_INO) -> set[str]:
    """The groups of ``groups`` that an agent made (their name parses) and whose agent is
    provably gone: its pid is free or holds a process started at another time, in our own
    PID namespace; or, seen from the initial namespace, no process is left in its
    namespace. Any other group (another tool's, a live agent's, one we cannot check) stays."""
    own = _pid_namespace(proc_root / "self")
    in_use: set[int] | None = None
    listed = False
    dead: set[str] = set()
    for group in groups:
        m = _AGENT_GROUP.match(group)
        if m is None or own is None:
            continue
        namespace, pid, start = (int(v, 16) for v in m.groups()[:3])
        if namespace == own:
            if _start_time(proc_root, pid) != start:
                dead.add(group)
        elif own == initial:
            if not listed:
                in_use, listed = _namespaces_in_use(proc_root), True
            if in_use is not None and namespace not in in_use:
                dead.add(group)
    return dead


def remove_stale(tracefs: Path, keep: str = "", proc_root: Path = Path("/proc")) -> int:
    """Remove the definitions of agents that are gone (``dead_groups``); ``keep`` is our
    own group. Returns how many."""
    found = definitions(tracefs)
    dead = dead_groups({group for group, _ in found} - {keep}, proc_root)
    return sum(1 for group, name in found if group in dead and remove(tracefs, group, name))

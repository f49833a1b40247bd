"""The /proc readers of profagent. Every function takes ``(proc_root, pid)`` in that order,
so tests and containers can point them at another root (a fixture folder, /host/proc).

Raises OSError where the docstring says so; the callers decide what a missing or
unreadable file means (usually: the process is gone, or belongs to another user).
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def read_environ(proc_root: Path, pid: int) -> dict[str, str]:
    """/proc/PID/environ. Raises OSError (PermissionError, FileNotFoundError...)."""
    raw = (proc_root / str(pid) / "environ").read_bytes()
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def read_nspid(proc_root: Path, pid: int) -> tuple[int, ...]:
    """Every PID the process has, outermost namespace first (/proc/PID/status NSpid);
    ``(pid,)`` when it cannot be read or the kernel predates NSpid."""
    try:
        with open(proc_root / str(pid) / "status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    return tuple(int(x) for x in line.split()[1:])
    except (OSError, ValueError):
        pass
    return (pid,)


def python_paths(proc_root: Path, pid: int) -> list[str]:
    """The executable and the mapped files naming python (to tell the target's Python
    without ptrace); empty when /proc cannot be read."""
    root = proc_root / str(pid)
    names: list[str] = []
    try:
        names.append(os.readlink(root / "exe"))
    except OSError:
        pass
    try:
        with open(root / "maps", errors="replace") as fh:
            names.extend(line.rsplit(" ", 1)[-1].strip() for line in fh if "python" in line)
    except OSError:
        pass
    return names


PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit()


def start_ticks(proc_root: Path, pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the
    PID, it names one process (a PID is reused, a start time with it is not). None if gone."""
    fields = _stat_fields(proc_root, pid)
    return int(fields[19]) if fields else None


def exited(proc_root: Path, pid: int, born: int | None = None) -> bool:
    """True if the process is gone or on its way out: no /proc entry, a zombie or dead task,
    a task inside exit() (PF_EXITING: its memory may already be unmapped), or another
    process under the same PID (``born``: its :func:`start_ticks` when it was chosen).

    ``psutil.pid_exists`` is True for all but the first, so it cannot tell a reader that
    failed on an exiting target from one that failed on a live one.
    """
    fields = _stat_fields(proc_root, pid)
    if fields is None:
        return True
    if fields[0] in (b"Z", b"X", b"x") or int(fields[6]) & PF_EXITING:
        return True
    return born is not None and int(fields[19]) != born


def _stat_fields(proc_root: Path, pid: int) -> list[bytes] | None:
    """/proc/PID/stat after the command name (fields 3..), or None if it cannot be read."""
    try:
        stat = (proc_root / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    fields = stat.rpartition(b")")[2].split()  # the name may hold spaces and parentheses
    return fields if len(fields) >= 20 else None


def read_text_or_empty(path: str | Path) -> str:
    """A small /proc or /sys file, or "" if it cannot be read."""
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def boot_time(proc_root: Path) -> float:
    """Seconds since the epoch at boot (``btime`` in /proc/stat). Raises OSError."""
    for line in (proc_root / "stat").read_text().splitlines():
        if line.startswith("btime"):
            return float(line.split()[1])
    raise OSError(f"no btime in {proc_root / 'stat'}")


def process_table(proc_root: Path) -> dict[int, tuple[int, float, str]]:
    """pid -> (ppid, create_time, full command line) of every live, non-zombie process.

    ``create_time`` is computed as psutil computes it (boot time + start ticks), so it
    matches ``psutil.Process(pid).create_time()`` for the same /proc.
    """
    ticks = os.sysconf("SC_CLK_TCK")
    booted = boot_time(proc_root)
    table: dict[int, tuple[int, float, str]] = {}
    for entry in os.scandir(proc_root):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            stat = (proc_root / entry.name / "stat").read_bytes()
            raw = (proc_root / entry.name / "cmdline").read_bytes()
        except OSError:  # gone between the listing and the read
            continue
        fields = stat.rpartition(b")")[2].split()  # the name may hold spaces and parentheses
        if len(fields) < 20 or fields[0] == b"Z":
            continue
        argv = raw.decode(errors="replace").rstrip("\0").split("\0")
        table[pid] = (int(fields[1]), int(fields[19]) / ticks + booted, " ".join(argv))
    return table

"""The /proc readers of profagent. Every function takes ``(proc_root, pid)`` in that order,
so tests and containers can point them at another root (a fixture folder, /host/proc).

Raises OSError where the docstring says so; the callers decide what a missing or
unreadable file means (usually: the process is gone, or belongs to another user).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from profagent.labels import bound

PROC = Path("/proc")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def read_environ(proc_root: Path, pid: int) -> dict[str, str]:
    """/proc/PID/environ, every name and value bounded by ``labels.bound`` (the process'
    owner chooses them; they become job ids, ranks and labels). Raises OSError
    (PermissionError, FileNotFoundError...)."""
    raw = (proc_root / str(pid) / "environ").read_bytes()
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[bound(key.decode(errors="replace"))] = bound(value.decode(errors="replace"))
    return env


def read_argv(proc_root: Path, pid: int, limit: int = 4096) -> list[str]:
    """The first ``limit`` bytes of /proc/PID/cmdline as arguments (any process may set a
    megabyte-long one; a launcher's own options come first). Raises OSError."""
    raw = _read_head(f"{proc_root}/{pid}/cmdline", limit)
    return [bound(a.decode(errors="replace")) for a in raw.rstrip(b"\0").split(b"\0")] if raw else []


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


def interpreter_files(proc_root: Path, pid: int) -> list[str]:
    """The paths py-spy opens to read the target's interpreter: its executable and every
    executable mapping whose file name (not its folder) names python: libpython, a python binary,
    as /proc shows them (a deleted file ends in " (deleted)"). Empty when /proc cannot be
    read. Raises nothing."""
    root = proc_root / str(pid)
    paths: list[str] = []
    try:
        paths.append(os.readlink(root / "exe"))
    except OSError:
        pass
    try:
        with open(root / "maps", "rb") as fh:
            for line in fh:
                if b"python" not in line:
                    continue
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or b"x" not in fields[1] or not fields[5].startswith(b"/"):
                    continue
                path = fields[5].rstrip(b"\n").decode(errors="surrogateescape")
                if "python" in path.rsplit("/", 1)[-1] and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


def read_children(proc_root: Path, pid: int) -> list[int] | None:
    """PIDs of the children started by the process' main thread (/proc/PID/task/PID/children).

    None when the file cannot be read: the process is gone, or the kernel was built
    without CONFIG_PROC_CHILDREN. Children started by other threads are not listed.
    """
    try:  # a string path, not pathlib: read for every process of the job every tick
        with open(f"{proc_root}/{pid}/task/{pid}/children", "rb") as fh:
            return [int(x) for x in fh.read().split()]
    except (OSError, ValueError):
        return None


PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit()


def start_ticks(proc_root: Path, pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the
    PID, it names one process (a PID is reused, a start time with it is not). None if gone."""
    fields = _stat_fields(proc_root, pid)
    return int(fields[19]) if fields else None


def read_identity(proc_root: Path, pid: int, booted: float) -> tuple[int, float] | None:
    """(ppid, create_time) of a live process from one /proc/PID/stat read; None if it is
    gone or a zombie. ``create_time`` is psutil's (``booted``: :func:`boot_time`)."""
    fields = _stat_fields(proc_root, pid)
    if fields is None or fields[0] in (b"Z", b"X", b"x"):
        return None
    return int(fields[1]), int(fields[19]) / CLOCK_TICKS + booted


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
        fields = _after_name(_read_head(f"{proc_root}/{pid}/stat", 4096))
    except OSError:
        return None
    return fields if len(fields) >= 20 else None


def _after_name(stat: bytes) -> list[bytes]:
    """The fields of a /proc/PID/stat text after the command name (which may hold spaces
    and parentheses)."""
    return stat.rpartition(b")")[2].split()


@dataclass(frozen=True)
class ProcessStats:
    """One process' resource counters, read straight from /proc (what psutil's
    cpu_times, memory_info, num_ctx_switches, num_threads, num_fds and io_counters
    give, in four reads instead of six and without psutil's per-call overhead)."""

    cpu_user: float  # seconds
    cpu_system: float
    cpu_iowait: float  # delayacct_blkio_ticks, as psutil's cpu_times().iowait
    rss: int  # bytes
    threads: int
    ctx_voluntary: int
    ctx_involuntary: int
    fds: int | None  # None: not ours to list (another user's process, without root)
    read_bytes: int | None  # None: /proc/PID/io not readable
    write_bytes: int | None
    run_queue: float | None = None  # seconds its main thread waited for a CPU; None: no schedstat


def _number_after(text: bytes, key: bytes) -> int | None:
    """The number on the line starting with ``key`` (without its newline), else None."""
    at = text.find(b"\n" + key)
    if at < 0:
        return None
    start = at + 1 + len(key)
    end = text.find(b"\n", start)
    try:
        return int(text[start:end if end >= 0 else len(text)])
    except ValueError:
        return None


def read_process_stats(proc_root: Path, pid: int) -> ProcessStats:
    """/proc/PID/stat, status (context switches), io and the fd folder. Raises OSError
    (FileNotFoundError, ProcessLookupError) when the process is gone. Read every tick for
    every process of the job: plain strings and ``bytes.find``, no pathlib (half its cost)."""
    root = f"{proc_root}/{pid}"
    fields = _after_name(_read_head(root + "/stat", 4096))
    if len(fields) < 40:
        raise FileNotFoundError(f"{root}/stat is truncated")
    status = _read_head(root + "/status", 16384)
    try:
        fds: int | None = len(os.listdir(root + "/fd"))
    except PermissionError:
        fds = None
    try:
        io = b"\n" + _read_head(root + "/io", 4096)
        read_bytes, write_bytes = _number_after(io, b"read_bytes:"), _number_after(io, b"write_bytes:")
    except PermissionError:
        read_bytes = write_bytes = None
    run_queue = _run_queue(root)
    # stat fields after the name, 0-based: 11 utime, 12 stime, 17 num_threads, 21 rss (pages),
    # 39 delayacct_blkio_ticks
    return ProcessStats(
        cpu_user=int(fields[11]) / CLOCK_TICKS,
        cpu_system=int(fields[12]) / CLOCK_TICKS,
        cpu_iowait=int(fields[39]) / CLOCK_TICKS,
        rss=int(fields[21]) * PAGE_SIZE,
        threads=int(fields[17]),
        ctx_voluntary=_number_after(status, b"voluntary_ctxt_switches:") or 0,
        ctx_involuntary=_number_after(status, b"nonvoluntary_ctxt_switches:") or 0,
        fds=fds,
        read_bytes=read_bytes,
        write_bytes=write_bytes,
        run_queue=run_queue,
    )


def _run_queue(root: str) -> float | None:
    """Seconds the process's main thread (the thread-group leader) has been runnable but
    waiting for a CPU: /proc/PID/schedstat's second field, in ns. None on a kernel built
    without schedstats."""
    try:
        fields = _read_head(root + "/schedstat", 128).split()
    except FileNotFoundError:
        if os.path.exists(root):
            return None  # no schedstats here; the process itself is still there
        raise
    return int(fields[1]) / 1e9 if len(fields) >= 2 and fields[1].isdigit() else None


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


CMDLINE_READ_MAX = 4096  # bytes of a command line read by a scan (a rule needs its start only)


def _read_head(path: str | Path, limit: int) -> bytes:
    """The first ``limit`` bytes of a /proc file (one read: /proc files are generated whole).
    Raises OSError. Readers of every tick pass plain strings: pathlib cost half their time."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


def process_table(proc_root: Path) -> dict[int, tuple[int, float, str]]:
    """pid -> (ppid, create_time, command line) of every live, non-zombie process.

    ``create_time`` is computed as psutil computes it (boot time + start ticks), so it
    matches ``psutil.Process(pid).create_time()`` for the same /proc. Only the first
    ``CMDLINE_READ_MAX`` bytes of each command line are read: any process may set a
    megabyte-long one, and a scan reads thousands.
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
            raw = _read_head(proc_root / entry.name / "cmdline", CMDLINE_READ_MAX)
        except OSError:  # gone between the listing and the read
            continue
        fields = _after_name(stat)
        if len(fields) < 20 or fields[0] == b"Z":
            continue
        argv = raw.decode(errors="replace").rstrip("\0").split("\0")
        table[pid] = (int(fields[1]), int(fields[19]) / ticks + booted, " ".join(argv))
    return table


def children_map(proc_root: Path) -> dict[int, list[int]]:
    """ppid -> child pids of every live process (one /proc/PID/stat read each)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir(proc_root):
        if not entry.name.isdigit():
            continue
        try:
            stat = _read_head(proc_root / entry.name / "stat", 4096)
        except OSError:
            continue
        fields = _after_name(stat)
        if len(fields) >= 2 and fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def read_credentials(proc_root: Path, pid: int) -> tuple[int, frozenset[int]] | None:
    """The effective uid and every gid (effective and supplementary) of a process, from
    /proc/PID/status; None when it cannot be read (gone, or another PID namespace)."""
    uid: int | None = None
    gids: set[int] = set()
    try:
        with open(proc_root / str(pid) / "status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Uid:"):
                    uid = int(line.split()[2])
                elif line.startswith("Gid:"):
                    gids.add(int(line.split()[2]))
                elif line.startswith("Groups:"):
                    gids.update(int(g) for g in line.split()[1:])
    except (OSError, ValueError, IndexError):
        return None
    return None if uid is None else (uid, frozenset(gids))

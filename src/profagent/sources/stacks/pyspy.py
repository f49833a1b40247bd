"""Running py-spy: find the binary, check it fits the target, run windows, stop them.

Every child started here dies with the agent and ends by itself, and the target is never
left stopped (see ``lifeline`` and ``resume_if_stopped``).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import io
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from profagent.errors import SourceUnavailable
from profagent.labels import printable
from profagent.system.procfs import (
    PROC,
    exited,
    interpreter_files,
    python_paths,
    read_text_or_empty,
)
from profagent.system.safefs import UnsafePath, open_regular

log = logging.getLogger(__name__)

PTRACE_FIX = (
    "run profagent as root or with CAP_SYS_PTRACE, or set kernel.yama.ptrace_scope=0 "
    "(containers: docker --cap-add SYS_PTRACE, Kubernetes securityContext.capabilities.add: [SYS_PTRACE])"
)
PR_SET_PDEATHSIG = 1

# The oldest py-spy release that reads each Python minor version.
MIN_PYSPY_FOR = {(3, 12): (0, 4, 0), (3, 13): (0, 4, 0), (3, 14): (0, 4, 2)}
NEWEST_KNOWN_MINOR = (3, 14)


class PySpyProblem(SourceUnavailable):
    """py-spy cannot run here (``problem: fix``, and a ``reason`` label)."""


def find_pyspy() -> str:
    """The py-spy binary of the installed ``py-spy`` package (else next to our Python, else
    on PATH). Raises PySpyProblem if there is none."""
    try:
        for f in importlib.metadata.distribution("py-spy").files or ():
            if f.name == "py-spy" and f.parent.name == "bin":
                path = Path(str(f.locate())).resolve()
                if os.access(path, os.X_OK):
                    return str(path)
    except importlib.metadata.PackageNotFoundError:
        pass
    for candidate in (Path(sys.executable).parent / "py-spy", shutil.which("py-spy")):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    raise PySpyProblem("py-spy is not installed", "pip install 'py-spy>=0.4.0'", "pyspy_missing")


def pyspy_version(binary: str) -> tuple[int, ...]:
    """py-spy's version as a tuple, from the package metadata or ``--version``; () if unknown."""
    text = ""
    try:
        text = importlib.metadata.version("py-spy")
    except importlib.metadata.PackageNotFoundError:
        try:
            text = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            return ()
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    return tuple(int(x) for x in m.groups()) if m else ()


@dataclass(frozen=True)
class PythonBuild:
    major: int
    minor: int
    free_threaded: bool

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}{'t' if self.free_threaded else ''}"


_PY_NAME = re.compile(r"(?:^|/)(?:lib)?python(\d)\.(\d+)(t?)(?:\b|\.so|$)")


def target_python(pid: int, proc_root: str | Path = "/proc") -> PythonBuild | None:
    """The target's Python from its executable name and mapped libpython (no ptrace needed).
    None when it cannot be told (unreadable /proc, an unusual binary name)."""
    for name in python_paths(Path(proc_root), pid):
        m = _PY_NAME.search(name)
        if m:
            return PythonBuild(int(m.group(1)), int(m.group(2)), m.group(3) == "t")
    return None


DELETED = " (deleted)"


def unsafe_interpreter(pid: int, proc_root: Path = PROC) -> str | None:
    """Why py-spy must not read ``pid``, or None when its interpreter files look safe to open.

    py-spy, run by root, opens ``/proc/PID/root`` + each path the target maps its Python
    from. The target's owner chooses those paths: a mapped libpython unlinked, with a FIFO
    planted at "<path> (deleted)", blocked py-spy forever; a symlink there made root's
    py-spy open /etc/shadow. So every such file must be there, a regular file (not a link,
    FIFO, socket or device, checked without following or blocking), and not deleted. A
    swap after this check is what the run's deadline (see sampler.DEADLINE_SLACK) is for.
    """
    for path in interpreter_files(proc_root, pid):
        if path.endswith(DELETED):
            return f"its Python ({printable(path[:200])}) is a deleted file: not read, a path its owner can plant"
        try:
            os.close(open_regular(f"{proc_root}/{pid}/root{path}"))
        except UnsafePath as exc:
            return f"its Python ({printable(path[:200])}) is refused, {exc}"
        except FileNotFoundError:
            return f"its Python ({printable(path[:200])}) is not there: not read"
        except OSError:
            continue  # gone, or /proc/PID/root unreadable: py-spy will say so
    return None


def compatibility(pyspy: tuple[int, ...], target: PythonBuild | None) -> str | None:
    """None if this py-spy can read that Python, else one line naming the problem and the fix."""
    if target is None or not pyspy:
        return None
    found = ".".join(map(str, pyspy))
    if target.free_threaded:
        return (f"the target runs a free-threaded Python {target}, which py-spy {found} cannot read: "
                "sample a build with the GIL, or turn stacks off with --no-stacks")
    need = MIN_PYSPY_FOR.get((target.major, target.minor))
    if need and pyspy < need:
        want = ".".join(map(str, need))
        return f"py-spy {found} cannot read Python {target}: pip install 'py-spy>={want}'"
    if (target.major, target.minor) > NEWEST_KNOWN_MINOR:
        log.warning("Python %s is newer than py-spy %s is known to read; stacks may fail", target, found)
    return None


def die_with_parent() -> Callable[[], None] | None:
    """A preexec function that makes the child die with us (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


# Fixed places only, never $PATH: the agent runs it as root beside users who can write folders.
SETPRIV_PATHS = ("/usr/bin/setpriv", "/bin/setpriv")
SHELL = "/bin/sh"


def _root_owned_executable(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == 0 and not st.st_mode & 0o022 and bool(st.st_mode & 0o111)


# Run by setpriv once the death signal is set: if the agent died before that (the child was
# reparented), exit; else become the command. Without it, an agent killed in that instant
# would leave a py-spy behind.
_STILL_OURS = 'test "$PPID" = "$0" && exec "$@"'


# py-spy writes its output only when a ``record`` ends, and ends cleanly only on SIGINT
# or when its ``--duration`` is over. Every child started here:
#
# - runs in its own session (a Ctrl-C on the agent's terminal is ours to forward);
# - gets ``PR_SET_PDEATHSIG`` = SIGKILL, so it dies with the agent even on SIGKILL (set by
#   ``setpriv`` where util-linux has it, so the agent is not forked: see ``lifeline``);
# - is bounded anyway: a ``record`` window ends by itself after ``--duration``.
@functools.cache
def lifeline() -> tuple[str, ...]:
    """A command prefix that gives the child PR_SET_PDEATHSIG=SIGKILL with no preexec
    function (util-linux's ``setpriv --pdeathsig``, then a shell that checks the agent
    still is its parent and execs the command, all under one PID); () where setpriv is
    missing or too old (before 2.33). Append the agent's PID, then the command.

    A preexec function makes subprocess fork the agent instead of vfork: copying its page
    tables cost the agent 1.7 ms of CPU and the child 2.6 ms more, at every py-spy run.
    """
    path = next((p for p in SETPRIV_PATHS if _root_owned_executable(p)), None)
    if path is None or not _root_owned_executable(SHELL) or not sys.platform.startswith("linux"):
        return ()
    try:
        usage = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=5, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return (path, "--pdeathsig", "KILL", "--", SHELL, "-c", _STILL_OURS) if "--pdeathsig" in usage else ()


def spawn(args: Sequence[str], stderr_path: Path | None = None, stdout_path: Path | None = None) -> subprocess.Popen:
    """Start py-spy in its own session, bound to our lifetime. Output goes to the given
    files (else is discarded). Raises OSError if it cannot be started."""
    err = open(stderr_path, "wb") if stderr_path else subprocess.DEVNULL  # noqa: SIM115
    out = open(stdout_path, "wb") if stdout_path else subprocess.DEVNULL  # noqa: SIM115
    prefix = lifeline()
    try:
        return subprocess.Popen(
            [*prefix, str(os.getpid()), *args] if prefix else list(args),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
            # without setpriv: a single prctl call in the forked child (takes no lock there)
            preexec_fn=None if prefix else die_with_parent(),
            env={**os.environ, "RUST_BACKTRACE": "0"},
        )
    finally:
        for fh in (err, out):
            if fh is not subprocess.DEVNULL:
                fh.close()  # type: ignore[union-attr]


def record_args(
    binary: str, pid: int, seconds: float, rate: int, fmt: str, output: Path, nonblocking: bool, idle: bool = True,
    native: bool = False,
) -> list[str]:
    """``idle``: keep samples of threads that wait (the agent needs them to see a hang).
    ``native``: add C/C++ frames; py-spy then has to pause the target at each sample."""
    args = [binary, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
            "--rate", str(rate), "--format", fmt, "--output", str(output), "--threads"]
    if idle:
        args.append("--idle")
    if native:
        args.append("--native")
    elif nonblocking:
        args.append("--nonblocking")
    return args


def dump_args(binary: str, pid: int, nonblocking: bool) -> list[str]:
    args = [binary, "dump", "--pid", str(pid), "--json"]
    if nonblocking:
        args.append("--nonblocking")
    return args


DUMP_MODES = ("native", "nonblocking", "blocking")


def dump_text_args(binary: str, pid: int, mode: str) -> list[str]:
    """A human-readable dump of every thread. ``native`` adds C/C++ frames and needs a
    blocking dump (py-spy pauses the target only while it reads the stacks)."""
    extra = {"native": ["--native"], "nonblocking": ["--nonblocking"], "blocking": []}[mode]
    return [binary, "dump", "--pid", str(pid), *extra]


MAX_DUMP_TEXT = 2 << 20  # bytes of one text dump kept (a bundle's stacks file); the rest is read and dropped
MAX_DUMP_STDERR = 64 << 10


@dataclass(frozen=True)
class DumpOutput:
    out: str
    err: str
    truncated: int  # bytes of stdout past MAX_DUMP_TEXT, read and dropped (0: whole)


def communicate_capped(proc: subprocess.Popen, timeout: float, max_out: int = MAX_DUMP_TEXT,
                       max_err: int = MAX_DUMP_STDERR) -> DumpOutput:
    """``proc.communicate`` with a cap on what is kept: a job's 1,000-deep stacks of
    4,000-character names made 7 MiB a dump, and 32 of them held the agent at 620 MB.
    Past the cap the pipe is still read (py-spy never blocks on it) and dropped; the text
    kept ends at a line's end. ``proc``: binary pipes. Raises subprocess.TimeoutExpired."""
    kept: dict[int, tuple[bytes, int]] = {}

    def drain(pipe: io.BufferedReader, cap: int) -> None:
        chunks, size, dropped = [], 0, 0
        try:
            while block := pipe.read1(1 << 16):
                room = max(0, cap - size)
                chunks.append(block[:room])
                size += min(room, len(block))
                dropped += len(block) - min(room, len(block))
        except (OSError, ValueError):
            pass  # closed under it: the dump was given up
        kept[id(pipe)] = (b"".join(chunks), dropped)

    readers = [threading.Thread(target=drain, args=(pipe, cap), daemon=True, name="profagent-dump-read")
               for pipe, cap in ((proc.stdout, max_out), (proc.stderr, max_err)) if pipe is not None]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout
    try:
        proc.wait(timeout=max(0.0, timeout))
    finally:
        for t in readers:  # the pipes close once the child (and any it left) exits or is killed
            t.join(max(0.1, deadline - time.monotonic()))
    out, dropped = kept.get(id(proc.stdout), (b"", 0))
    err, _ = kept.get(id(proc.stderr), (b"", 0))
    if dropped:
        cut = out.rfind(b"\n")
        dropped += len(out) - (cut + 1)
        out = out[:cut + 1]
    return DumpOutput(out.decode(errors="replace"), err.decode(errors="replace"), dropped)


def failure_reason(stderr: str, pid: int, born: int | None = None, proc_root: Path = PROC) -> str:
    """Map a failed py-spy run to a bounded reason: permission, target_gone, torn_read or pyspy_failed.

    A target that exited, is exiting or is an unreaped zombie is ``target_gone`` whatever
    py-spy said: reading an exiting process fails in many ways ("Failed to find a python
    interpreter in the .data section" once its memory is unmapped). ``born``: the target's
    start time (procfs.start_ticks) when py-spy started, so a reused PID counts as gone.
    """
    if exited(proc_root, pid, born):
        return "target_gone"
    # py-spy says "Permission Denied", or "Permission denied (os error 13)" under an error
    # that also reads "Check that the process is running" (root without CAP_SYS_PTRACE)
    lowered = stderr.lower()
    if "permission denied" in lowered or "operation not permitted" in lowered:
        return "permission"
    if "Check that the process is running" in stderr or "No such process" in stderr:
        return "target_gone"
    # a non-blocking read raced the target rewriting its frames: common in an interpreter
    # still starting up ("Failed to copy PyCodeObject ... Bad address"); the next read is fine
    if "Failed to get stack traces" in stderr or "Bad address (os error 14)" in stderr:
        return "torn_read"
    # an interpreter being torn down (a rank exiting) or not set up yet: py-spy cannot find it
    # in the .data section; read again at once, and the process is usually gone by then
    if "Failed to find a python interpreter" in stderr:
        return "torn_read"
    return "pyspy_failed"


def first_line(stderr: str) -> str:
    for line in stderr.splitlines():
        line = line.strip()
        if line and not line.startswith(("py-spy>", "Stack backtrace")):
            return line[:200]
    return "no output"


def stop_all(procs: Sequence[subprocess.Popen], grace: float = 0.4) -> None:
    """SIGINT every live child (py-spy resumes a blocked target on SIGINT), SIGKILL whoever
    is still there after ``grace`` seconds, and reap them all. Returns within grace + ~0.1 s."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        _signal(p, signal.SIGINT)
    deadline = time.monotonic() + grace
    while live and time.monotonic() < deadline:
        live = [p for p in live if p.poll() is None]
        if live:
            time.sleep(0.02)
    for p in live:
        _signal(p, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            log.warning("py-spy PID %d did not exit after SIGKILL", p.pid)


def interrupt(proc: subprocess.Popen, sig: int = signal.SIGINT) -> None:
    """Stop a py-spy record early: on SIGINT it stops sampling, writes what it has sampled,
    resumes a target it had stopped, and exits 0. ``os.kill``, not ``Popen.send_signal``:
    that polls, and a child reaped by waitpid loses its CPU time (system/cputime.reap).
    The caller reaps ``proc``, so its PID cannot have been reused."""
    if proc.returncode is None:
        try:
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def is_stopped(pid: int) -> bool:
    """True if the process is in state T (job control stop: Slurm suspend, Ctrl-Z, a debugger)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


# With ``--nonblocking`` py-spy never stops the target. In blocking mode a killed py-spy
# can leave the target stopped (py-spy issues #390, #416), so ``resume_if_stopped`` sends
# SIGCONT to a target found in state T after a blocking window, unless it was already
# stopped before the window (someone else's stop, e.g. a Slurm suspend).
def resume_if_stopped(pid: int, stopped_before: bool) -> bool:
    """SIGCONT the target if a blocking py-spy left it stopped (state T). True if it did.

    ``stopped_before`` is :func:`is_stopped` read before py-spy started: a target someone
    else stopped (a Slurm suspend) is not ours to resume, so it is left as it was.
    """
    if stopped_before:
        return False
    try:
        if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
            os.kill(pid, signal.SIGCONT)
            return True
    except (psutil.Error, ProcessLookupError):
        pass
    return False


def has_cap_sys_ptrace() -> bool:
    for line in read_text_or_empty("/proc/self/status").splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) & (1 << 19))
    return False

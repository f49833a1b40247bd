"""`profagent stacks`: record one process with py-spy into a file, no agent needed."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import psutil

from profagent.errors import UserError
from profagent.sources.stacks.pyspy import (
    PTRACE_FIX,
    PySpyProblem,
    compatibility,
    die_with_parent,
    failure_reason,
    find_pyspy,
    first_line,
    is_stopped,
    pyspy_version,
    record_args,
    resume_if_stopped,
    stop_all,
    target_python,
    unsafe_interpreter,
)

FORMATS = {"flamegraph": "flamegraph", "speedscope": "speedscope", "folded": "raw"}


def record_to_file(
    pid: int, seconds: int, fmt: str, output: Path, rate: int = 100, nonblocking: bool = True,
    idle: bool = False,
) -> int:
    """``profagent stacks``: record one process for ``seconds`` into ``output``; returns the
    sample count. ``idle`` keeps waiting threads (off by default: a DataLoader's
    QueueFeederThread, asleep, can fill most of a flamegraph). Raises UserError (one line: problem and fix) on anything the user can fix."""
    if fmt not in FORMATS:
        raise UserError(f"unknown format {fmt!r}", f"use one of {', '.join(FORMATS)}")
    if not psutil.pid_exists(pid):
        raise UserError(f"no process with PID {pid}", "check the PID with `ps -ef` or `pgrep -f train`")
    output = Path(output)
    if not output.parent.is_dir():
        raise UserError(f"folder {output.parent} does not exist", "create it or choose another --output")
    try:
        binary = find_pyspy()
        problem = compatibility(pyspy_version(binary), target_python(pid))
    except PySpyProblem as exc:
        raise UserError(exc.problem, exc.fix) from None
    if problem:
        raise UserError(problem)
    unsafe = unsafe_interpreter(pid)
    if unsafe:
        raise UserError(f"PID {pid} not recorded: {unsafe}", "record a process whose Python is a regular file")
    # py-spy writes a file of our own beside the output, renamed into place once it is
    # good: a failed run leaves nothing behind and never truncates an existing output.
    fd, name = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".partial")
    os.close(fd)
    partial = Path(name)
    try:
        samples = _record(binary, pid, seconds, rate, fmt, partial, nonblocking, idle)
        os.chmod(partial, 0o666 & ~_umask())
        os.replace(partial, output)
        return samples
    finally:
        partial.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


RECORD_SLACK = 30  # seconds py-spy may run past --seconds (attach, writing a flamegraph) before it is killed
NO_SAMPLES = "No stack counts found"  # py-spy's flamegraph writer, when no sample was kept


def _record(binary: str, pid: int, seconds: int, rate: int, fmt: str, output: Path, nonblocking: bool,
            idle: bool) -> int:
    args = record_args(binary, pid, seconds, rate, FORMATS[fmt], output, nonblocking, idle=idle)
    stopped_before = is_stopped(pid)
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=die_with_parent(),
                            env={**os.environ, "RUST_BACKTRACE": "0"})
    try:
        out, err = proc.communicate(timeout=seconds + RECORD_SLACK)
    except KeyboardInterrupt:  # let py-spy write what it has, then stop
        stop_all([proc], grace=2.0)
        out, err = "", ""
    except subprocess.TimeoutExpired:  # blocked (a file its target planted): never wait for good
        stop_all([proc], grace=0.2)
        raise UserError(f"py-spy did not finish within {seconds + RECORD_SLACK} s on PID {pid}: killed",
                        "check the process with `profagent doctor`, or try again") from None
    finally:
        if not nonblocking:
            resume_if_stopped(pid, stopped_before)
    m = re.search(r"Samples: (\d+)", out)
    samples = int(m.group(1)) if m else 0
    if NO_SAMPLES in err or (proc.returncode == 0 and m and samples == 0 and not idle):
        raise UserError(f"py-spy saw no running Python code in PID {pid} in {seconds} s: every thread waited",
                        "add --idle to record waiting threads too (sleep, locks, queues), or --seconds longer")
    if proc.returncode != 0 or not output.exists() or output.stat().st_size == 0:
        reason = failure_reason(err, pid)
        if reason == "permission":
            raise UserError(f"ptrace denied on PID {pid}", PTRACE_FIX)
        if reason == "target_gone":
            raise UserError(f"PID {pid} exited before py-spy could read it", "attach to a running process")
        raise UserError(f"py-spy failed on PID {pid} ({first_line(err)})", "check that it is a Python process")
    return samples

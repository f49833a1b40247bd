"""Real child processes: waiting on them, killing whole trees, their py-spy children."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

# A predicate that costs CPU (parsing an agent's whole /metrics takes 50-250 ms) polls at
# most this share of the time: on 2 cores the suite's own polling competes with the jobs
# and agents it waits on.
POLL_DUTY = 0.25


def wait_for(predicate: Callable[[], object], timeout: float = 15.0, interval: float = 0.1, what: str = "condition"):
    """Poll until predicate() is truthy; return its value or fail the test. Polls every
    ``interval`` seconds, or less often where the predicate's own CPU time asks it."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        cpu = time.thread_time()
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # not ready yet
            last_exc = exc
        cost = time.thread_time() - cpu
        time.sleep(max(0.0, min(deadline - time.monotonic(), max(interval, cost * (1 / POLL_DUTY - 1)))))
    pytest.fail(f"timed out waiting for {what} (last error: {last_exc})")


def pyspy_processes(of: int | None = None, sampling: int | None = None, zombies: bool = False) -> list[psutil.Process]:
    """The py-spy processes descending from PID ``of`` (None: anywhere on the machine, so an
    orphan that outlived its agent is found too), only those sampling PID ``sampling`` if
    given; zombies (exited, not yet reaped) only when asked."""
    procs = psutil.process_iter() if of is None else psutil.Process(of).children(recursive=True)
    found = []
    for p in procs:
        try:
            if p.name() != "py-spy" or (not zombies and p.status() == psutil.STATUS_ZOMBIE):
                continue
            if sampling is not None and str(sampling) not in p.cmdline():
                continue
            found.append(p)
        except psutil.Error:
            continue
    return found


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 10) -> int:
    """Send ``sig`` (the process's own clean stop), wait ``timeout`` s, then SIGKILL; reaped
    either way. Returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def kill_tree(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGKILL a child and every descendant, then reap them.

    The process group is not enough: torchrun starts each rank in its own session. So the
    tree is frozen first (SIGSTOP, top down, until no new descendant appears: a stopped
    process cannot fork), then every process found is killed, and all are waited for.

    A child already reaped (``returncode`` set) is left alone: its PID, and its process
    group's, may belong to another process by now (pid_max is 32768 here, and the suite
    wraps it), such as another test's agent in a parallel worker. Until it is reaped, a
    child keeps its PID even as a zombie.
    """
    if proc.returncode is not None:
        return
    try:
        root = psutil.Process(proc.pid)
    except psutil.Error:
        root = None
    tree: dict[int, psutil.Process] = {}
    frontier = [root] if root is not None else []
    while frontier:
        found: list[psutil.Process] = []
        for p in frontier:
            with contextlib.suppress(psutil.Error):
                p.suspend()
            tree.setdefault(p.pid, p)
            with contextlib.suppress(psutil.Error):
                found += [c for c in p.children(recursive=True) if c.pid not in tree]
        frontier = found
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(proc.pid) == proc.pid:  # started with start_new_session=True
            os.killpg(proc.pid, signal.SIGKILL)
    for p in tree.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    psutil.wait_procs([p for pid, p in tree.items() if pid != proc.pid], timeout=timeout)


class Children:
    """Real child processes started by a test, all killed (with their trees) afterwards."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def python(self, code: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        script = self.tmp / f"child_{len(self.procs)}.py"
        script.write_text(textwrap.dedent(code))
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen([sys.executable, str(script)], env=full_env, start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        for proc in self.procs:
            kill_tree(proc)

"""The agent's own CPU time, per part of the agent: what a node pays for each collector.

Each unit of work (a collect tick, a findings pass, a trace ingested, a py-spy loop step,
an HTTP request, a Kineto datagram) is charged to its collector with the calling thread's
CPU clock, so the figure is CPU, not wall time, and does not grow when the node is busy.
py-spy children are charged when they are reaped: ``wait4`` returns their rusage.
Waiting costs no CPU, so charging the work and not the whole thread loses only the
loops' own few instructions; watchdog's inotify thread (which parses nothing) is not counted.

One account per process, like the process_* families: the agent is one process.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class CpuAccount:
    def __init__(self, thread_clock: Callable[[], float] = time.thread_time) -> None:
        self._thread_clock = thread_clock
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}
        self._children: dict[str, float] = {}

    def add(self, collector: str, seconds: float) -> None:
        if seconds <= 0:
            return
        with self._lock:
            self._seconds[collector] = self._seconds.get(collector, 0.0) + seconds

    def add_child(self, collector: str, seconds: float) -> None:
        """CPU of a reaped child process run for ``collector`` (counted in its total too)."""
        if seconds <= 0:
            return
        with self._lock:
            self._seconds[collector] = self._seconds.get(collector, 0.0) + seconds
            self._children[collector] = self._children.get(collector, 0.0) + seconds

    @contextmanager
    def charge(self, collector: str) -> Iterator[None]:
        """Charge the CPU the calling thread spends in the block to ``collector``."""
        began = self._thread_clock()
        try:
            yield
        finally:
            self.add(collector, self._thread_clock() - began)

    def totals(self) -> dict[str, float]:
        """Seconds per collector, children included."""
        with self._lock:
            return dict(self._seconds)

    def children(self) -> dict[str, float]:
        """Seconds of child processes per collector (py-spy for ``stacks``)."""
        with self._lock:
            return dict(self._children)


CPU = CpuAccount()


def reap(proc: subprocess.Popen) -> float | None:
    """Reap ``proc`` if it has exited, without blocking: its CPU seconds, or None if it runs.

    ``Popen.poll()`` reaps with waitpid and loses the child's rusage; ``wait4`` keeps it.
    """
    if proc.returncode is not None:
        return 0.0
    try:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    except ChildProcessError:  # reaped elsewhere (Popen.wait in a stop path)
        proc.poll()
        return 0.0 if proc.returncode is not None else None
    if pid == 0:
        return None
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime

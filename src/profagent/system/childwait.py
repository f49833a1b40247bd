"""Sleep until a child process exits, a deadline passes, or another thread wakes us.

The py-spy sampler used to wake ten times a second to ask each child whether it had
ended: most of its CPU at steady pace, when a window lasts 20 s. A pidfd (Linux 5.3)
turns readable when its process exits, so one ``poll`` waits on every child, and a
self-pipe lets ``wake()`` cut the sleep short (new targets, a native window asked, stop).
Where pidfds are missing (old kernels) ``watch`` returns None and the caller polls.
"""

from __future__ import annotations

import os
import select
from collections.abc import Iterable


class ChildWaiter:
    def __init__(self) -> None:
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def close(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    @staticmethod
    def watch(pid: int) -> int | None:
        """A pidfd of ``pid`` (readable once it exits), or None where pidfds are missing.
        The caller closes it with :meth:`forget`."""
        try:
            return os.pidfd_open(pid)
        except (OSError, AttributeError):  # ENOSYS before Linux 5.3; ESRCH: gone already
            return None

    @staticmethod
    def forget(fd: int | None) -> None:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def wake(self) -> None:
        """Cut the current (or next) :meth:`wait` short. Safe from any thread."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # the pipe is full (a wake is pending anyway) or closed
            pass

    def wait(self, fds: Iterable[int], timeout: float) -> None:
        """Return when one of ``fds`` is readable (a child exited), ``wake()`` was
        called, or ``timeout`` seconds passed."""
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for fd in fds:
            poller.register(fd, select.POLLIN)
        ready = poller.poll(max(0, round(timeout * 1000)))
        if any(fd == self._wake_r for fd, _ in ready):
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except OSError:  # drained (EAGAIN)
                pass

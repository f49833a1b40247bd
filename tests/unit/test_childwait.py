"""ChildWaiter: a sleep cut short by a child's exit or a wake from another thread."""

from __future__ import annotations

import subprocess
import threading
import time

from profagent.system.childwait import ChildWaiter

LONG = 120.0  # a wait that returns early proves what woke it; the timeout would fail the test


def test_a_child_exit_ends_the_wait() -> None:
    waiter = ChildWaiter()
    child = subprocess.Popen(["sleep", "0.2"])
    fd = ChildWaiter.watch(child.pid)
    assert fd is not None
    try:
        began = time.monotonic()
        waiter.wait([fd], LONG)
        assert time.monotonic() - began < LONG / 2
        assert child.poll() is not None  # it woke because the child exited
    finally:
        ChildWaiter.forget(fd)
        child.wait()
        waiter.close()


def test_wake_ends_the_wait_from_another_thread_and_is_consumed() -> None:
    waiter = ChildWaiter()
    ready = threading.Event()
    woke = threading.Event()

    def sleeper() -> None:
        ready.set()
        waiter.wait([], LONG)
        woke.set()

    thread = threading.Thread(target=sleeper, daemon=True)
    thread.start()
    ready.wait()
    waiter.wake()
    assert woke.wait(LONG / 2)
    began = time.monotonic()
    waiter.wait([], 0.05)  # the wake was drained: this one times out
    assert time.monotonic() - began >= 0.04
    waiter.close()


def test_a_wake_before_the_wait_is_not_lost() -> None:
    waiter = ChildWaiter()
    waiter.wake()
    began = time.monotonic()
    waiter.wait([], LONG)
    assert time.monotonic() - began < LONG / 2
    waiter.close()


def test_watch_of_a_pid_that_does_not_exist_is_none() -> None:
    assert ChildWaiter.watch(2**22 + 12345) is None

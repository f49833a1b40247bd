"""Bounds for a test workload: it dies with its parent and after a maximum runtime.

A test that crashes, or a launcher killed without its children (torchrun starts each rank
in its own session), must never leave a workload running on a shared machine.

No watchdog thread: an extra Python thread would show up in the stacks the agent samples
(and could make a hung rank look busy), so the kernel does the watching (prctl, alarm).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def bound(max_seconds: int) -> None:
    """SIGKILL this process when its parent dies, and end it after ``max_seconds``."""
    parent = os.getppid()
    # SIGALRM has no Python handler, so its default action ends the process, even mid-sleep.
    signal.alarm(max_seconds)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        # No prctl (not Linux?): poll for the parent instead; this thread is the lesser evil.
        def watch_parent() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(3)

        threading.Thread(target=watch_parent, name="lifeline", daemon=True).start()
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(3)

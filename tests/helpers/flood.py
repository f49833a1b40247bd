"""An unprivileged attacker for the caps tests: `nobody` starting many cheap processes.

``flood(n, argv, env)`` starts one Python process as uid/gid 65534 (setpriv) that starts
``n`` children running ``argv[0]``'s program with the given argv and environment (e.g.
``sleep`` renamed ``python3 train.py``), then waits. ``stop()`` kills the whole group.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence

from helpers.processes import wait_for

NOBODY = 65534
SETPRIV = shutil.which("setpriv")
NEEDS = "needs root and setpriv to play nobody"
CAN_PLAY_NOBODY = os.geteuid() == 0 and SETPRIV is not None

_SPAWNER = """
import json, os, subprocess, sys, time
n, executable, argv, env = json.loads(os.environ["FLOOD_SPEC"])  # not in argv: no rule may match the spawner
kids = [subprocess.Popen(argv, executable=executable, env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(n)]
print("started", flush=True)
while True:
    time.sleep(3600)
"""


def as_nobody(args: Sequence[str]) -> list[str]:
    assert SETPRIV is not None
    return [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *args]


class Flood:
    def __init__(self, n: int, executable: str, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        import json

        spec = json.dumps([n, executable, list(argv), {"PATH": "/usr/bin:/bin", **(env or {})}])
        self.proc = subprocess.Popen(as_nobody([sys.executable, "-c", _SPAWNER]), stdout=subprocess.PIPE,
                                     text=True, start_new_session=True, cwd="/",
                                     env={"PATH": "/usr/bin:/bin", "FLOOD_SPEC": spec})
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        assert line.strip() == "started", f"the flood did not start ({self.proc.poll()})"
        self.n = n
        wait_for(lambda: len(self.pids()) >= n, timeout=60, what=f"{n} processes of nobody")

    def pids(self) -> list[int]:
        import psutil

        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children()]
        except psutil.Error:
            return []

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

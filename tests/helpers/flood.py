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
from collections.abc import Sequence

from helpers.nobody import as_nobody
from helpers.processes import wait_for

# Debian's own Python: the venv's interpreter may live under a 0700 home (pyenv in /root),
# which nobody cannot reach.
NOBODY_PYTHON = "/usr/bin/python3"
SETPRIV = shutil.which("setpriv")
NEEDS = "needs root and setpriv to play nobody"
CAN_PLAY_NOBODY = os.geteuid() == 0 and SETPRIV is not None

_SPAWNER = """
import json, os, subprocess, sys, time
n, executable, argv, env, extra = json.loads(sys.stdin.readline())  # not in argv: no rule may match the spawner
kids = [subprocess.Popen(argv, executable=executable, env={**env, **(extra[i] if extra else {})},
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for i in range(n)]
print("started", flush=True)
while True:
    time.sleep(3600)
"""




class Flood:
    def __init__(self, n: int, executable: str, argv: Sequence[str], env: dict[str, str] | None = None,
                 each: Sequence[dict[str, str]] = (), expect: int | None = None) -> None:
        """``each[i]``: extra environment of child i; ``expect``: processes to wait for
        (children and their own children), default ``n``."""
        import json

        spec = json.dumps([n, executable, list(argv), {"PATH": "/usr/bin:/bin", **(env or {})}, list(each)])
        self.proc = subprocess.Popen(as_nobody(NOBODY_PYTHON, "-c", _SPAWNER), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, start_new_session=True, cwd="/",
                                     env={"PATH": "/usr/bin:/bin"})
        assert self.proc.stdin is not None
        self.proc.stdin.write(spec + "\n")
        self.proc.stdin.close()
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        assert line.strip() == "started", f"the flood did not start ({self.proc.poll()})"
        self.n = n
        want = n if expect is None else expect
        wait_for(lambda: len(self.pids(recursive=expect is not None)) >= want, timeout=60,
                 what=f"{want} processes of nobody")

    def pids(self, recursive: bool = False) -> list[int]:
        import psutil

        try:
            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=recursive)]
        except psutil.Error:
            return []

    def stop(self) -> None:
        if self.proc.returncode is not None:  # reaped: its group id may be another's now
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

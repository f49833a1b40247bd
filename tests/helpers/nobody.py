"""The unprivileged attacker of the security tests: real processes of ``nobody``.

The tests run as root; ``setpriv`` drops to uid/gid 65534 with no supplementary group.
Scripts go in a folder ``nobody`` can read (the checkout may sit in root's 0700 home).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from helpers.processes import wait_for

NOBODY = 65534


def as_nobody(*cmd: str) -> list[str]:
    """``cmd`` run as nobody."""
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd]


def nobody_python(code: str, env: dict[str, str], folder: Path) -> subprocess.Popen:
    """Start ``code`` with the system Python as nobody, in its own session, with only
    ``env`` (and PATH); returns once the process runs as nobody. ``folder``: world-readable."""
    script = folder / f"job-{time.monotonic_ns()}.py"
    script.write_text(code)
    script.chmod(0o644)
    proc = subprocess.Popen(as_nobody("/usr/bin/python3", str(script)), env={"PATH": "/usr/bin:/bin", **env},
                            start_new_session=True)
    wait_for(lambda: os.stat(f"/proc/{proc.pid}").st_uid == NOBODY, what="nobody's process")
    return proc

"""The unprivileged attacker of the security tests: real processes of ``nobody``.

The tests run as root; ``setpriv`` drops to uid/gid 65534 with no supplementary group.
Scripts go in a folder ``nobody`` can read (the checkout may sit in root's 0700 home).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from helpers.processes import wait_for

NOBODY = 65534


def as_nobody(*cmd: str) -> list[str]:
    """``cmd`` run as nobody."""
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd]


def nobody_with_torch(script: Path, folder: Path) -> list[str]:
    """``script`` run as nobody by the suite's own Python (with torch), so that its process
    maps the very libtorch file root's jobs map: the venv is bound under ``folder`` (a fresh
    folder in /tmp) in a mount namespace of that process alone, as the checkout may sit in
    a folder nobody cannot enter (a 0700 one). The command keeps one PID throughout."""
    venv = folder / "venv"
    venv.mkdir(mode=0o755)
    venv.chmod(0o755)
    python = venv / Path(sys.executable).relative_to(sys.prefix)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount --bind "$0" "$1" && shift && exec "$@"',
            sys.prefix, str(venv), *as_nobody(str(python), str(script))]


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

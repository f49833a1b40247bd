"""agent/pyspy.py: locating py-spy, mapping its failures, stopping children, the doctor check."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from profagent.config import Config
from profagent.doctor.stacks import check_pyspy
from profagent.sources.stacks import pyspy


def test_find_pyspy_uses_the_installed_package() -> None:
    path = pyspy.find_pyspy()
    assert Path(path).name == "py-spy" and os.access(path, os.X_OK)
    assert Path(path).resolve() == (Path(sys.executable).parent / "py-spy").resolve()
    assert pyspy.pyspy_version(path) >= (0, 4, 0)


def test_failure_reasons_are_bounded() -> None:
    me = os.getpid()
    assert pyspy.failure_reason("Permission Denied: Try running again with elevated permissions", me) == "permission"
    assert pyspy.failure_reason("Error: Operation not permitted (os error 1)", me) == "permission"
    assert pyspy.failure_reason("Error: Failed to find python version from target process", me) == "pyspy_failed"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert pyspy.failure_reason("anything at all", dead.pid) == "target_gone"
    assert pyspy.first_line("\npy-spy> Sampling\nError: boom\nStack backtrace:\n 0: x") == "Error: boom"


def test_stop_all_kills_a_child_that_ignores_sigint_within_the_grace() -> None:
    code = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    stubborn = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    polite = pyspy.spawn([sys.executable, "-c", "import time; time.sleep(60)"])
    assert stubborn.stdout.readline().strip() == "up"
    began = time.monotonic()
    pyspy.stop_all([stubborn, polite], grace=0.3)
    # generous for a loaded machine, yet far below the 60 s an unkilled child would take
    assert time.monotonic() - began < 20.0
    assert stubborn.returncode == -signal.SIGKILL
    assert polite.returncode is not None


def test_spawned_children_die_with_their_parent() -> None:
    """PR_SET_PDEATHSIG: a py-spy child does not outlive an agent killed with SIGKILL."""
    code = (
        "import sys, time\n"
        "from profagent.sources.stacks import pyspy\n"
        "child = pyspy.spawn([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{child_pid}/stat") as fh:
            if fh.read().split(") ", 1)[1].startswith("Z"):
                return  # dead, waiting for init to reap it
        time.sleep(0.05)
    raise AssertionError("the child outlived its parent")


def test_doctor_check_reports_py_spy_and_a_live_dump() -> None:
    rows = {r.name: r for r in check_pyspy(Config())}
    assert rows["py-spy"].status == "ok"
    assert rows["ptrace policy"].status in ("ok", "warn", "fail")
    assert rows["py-spy dump"].status == "ok", rows["py-spy dump"]

"""`profagent doctor` rows for stack sampling: py-spy, the ptrace policy, a live dump."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

from profagent.config import Config
from profagent.doctor.check import FAIL, OK, WARN, Check
from profagent.sources.stacks.pyspy import (
    PTRACE_FIX,
    PySpyProblem,
    dump_args,
    failure_reason,
    find_pyspy,
    first_line,
    has_cap_sys_ptrace,
    pyspy_version,
)
from profagent.system.procfs import read_text_or_empty


def check_pyspy(config: Config) -> Iterator[Check]:
    """``profagent doctor`` rows: py-spy installed and fitting, ptrace policy, and a live
    py-spy dump of a child Python (which proves ptrace and process_vm_readv work here)."""
    try:
        binary = find_pyspy()
    except PySpyProblem as exc:
        yield Check("stacks", "py-spy", FAIL, exc.problem, exc.fix)
        return
    version = ".".join(map(str, pyspy_version(binary))) or "unknown version"
    yield Check("stacks", "py-spy", OK, f"{version} at {binary}")
    scope = read_text_or_empty("/proc/sys/kernel/yama/ptrace_scope")
    cap = has_cap_sys_ptrace()
    policy = f"yama ptrace_scope={scope or 'n/a'}, CAP_SYS_PTRACE {'yes' if cap else 'no'}"
    if scope == "3" or (scope == "2" and not cap):
        yield Check("stacks", "ptrace policy", FAIL, policy, PTRACE_FIX)
    elif scope == "1" and not cap:
        yield Check("stacks", "ptrace policy", WARN, policy + ": only descendants can be read", PTRACE_FIX)
    else:
        yield Check("stacks", "ptrace policy", OK, policy)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        time.sleep(0.3)
        res = subprocess.run(dump_args(binary, child.pid, True), capture_output=True, text=True, timeout=10)
        if res.returncode == 0:
            yield Check("stacks", "py-spy dump", OK, f"read a test Python (PID {child.pid})")
        elif failure_reason(res.stderr, child.pid) == "permission":
            yield Check("stacks", "py-spy dump", FAIL, "ptrace denied on a test Python", PTRACE_FIX)
        else:
            yield Check("stacks", "py-spy dump", FAIL, first_line(res.stderr), "see docs/stacks.md")
    except subprocess.TimeoutExpired:
        yield Check("stacks", "py-spy dump", FAIL, "py-spy dump hung for 10 s", "see docs/stacks.md")
    finally:
        child.kill()
        child.wait()

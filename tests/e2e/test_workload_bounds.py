"""The test workloads never outlive their tests (a leaked torchrun job once filled the machine).

- lifeline.bound: a rank in its own session (as torchrun starts them) dies with its launcher,
  and any workload ends after its maximum runtime;
- helpers.processes.kill_tree: kills a launcher and every descendant, in whatever session.
"""

from __future__ import annotations

import subprocess
import sys

import psutil

from helpers.paths import WORKLOADS
from helpers.processes import kill_tree, wait_for

# A launcher that starts one bounded rank in a new session, like torchrun, and waits on it.
LAUNCHER = """
import subprocess, sys
rank = subprocess.Popen([sys.executable, "-c", {code!r}], start_new_session=True)
print(rank.pid, flush=True)
rank.wait()
"""
RANK = f"""
import sys, time
sys.path.insert(0, {str(WORKLOADS)!r})
from lifeline import bound
bound({{seconds}})
print("bounded", flush=True)
while True:
    time.sleep(0.2)
"""


def start(seconds: int) -> tuple[subprocess.Popen, psutil.Process]:
    code = LAUNCHER.format(code=RANK.format(seconds=seconds))
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    rank = psutil.Process(int(launcher.stdout.readline()))
    assert rank.ppid() == launcher.pid and rank.pid != launcher.pid
    assert launcher.stdout.readline().strip() == "bounded"  # past bound(): the rank is armed
    return launcher, rank


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_rank_in_its_own_session_dies_with_its_launcher() -> None:
    launcher, rank = start(seconds=600)
    try:
        assert not gone(rank)
        launcher.kill()  # the launcher's group alone: the rank is not in it
        launcher.wait()
        wait_for(lambda: gone(rank), 15, what="the orphaned rank to die")
    finally:
        kill_tree(launcher)


def test_a_workload_ends_after_its_maximum_runtime() -> None:
    launcher, rank = start(seconds=2)
    try:
        assert launcher.wait(timeout=60) == 0  # its rank ended (SIGALRM), so it returned
        assert gone(rank)
    finally:
        kill_tree(launcher)


def test_kill_tree_kills_descendants_outside_the_process_group() -> None:
    launcher, rank = start(seconds=600)
    grandchild_code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); time.sleep(600)"
    # A plain descendant without any lifeline, in yet another session: only kill_tree can end it.
    helper = subprocess.Popen([sys.executable, "-c", grandchild_code], start_new_session=True)
    try:
        grandchild = wait_for(lambda: psutil.Process(helper.pid).children(), 15, what="the grandchild")[0]
        assert psutil.Process(helper.pid).children(recursive=True) == [grandchild]
        kill_tree(helper)
        assert helper.returncode is not None
        wait_for(lambda: gone(grandchild), 15, what="the grandchild to die")
    finally:
        kill_tree(launcher)
    assert gone(rank)

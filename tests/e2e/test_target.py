"""The target resolves real process trees into roles and ranks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers.processes import wait_for
from profagent.errors import UserError
from profagent.target import PidTarget, check_attachable
from profagent.target.pid import FULL_SCAN_EVERY, SETTLED_AFTER

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]

LAUNCHER = """
import os, subprocess, sys, time
kids = []
for rank in range(2):
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    code = "import subprocess,sys,time; w=subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']); time.sleep(60)"
    kids.append(subprocess.Popen([sys.executable, "-c", code], env=env))
time.sleep(60)
"""


def _tree_when(target: PidTarget, n: int):
    return wait_for(lambda: (t := target.refresh()) and len(t.processes) >= n and t, what=f"{n} processes")


def test_rank_with_grandchild(children) -> None:
    proc = children.python(
        """
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        time.sleep(60)
        """,
        env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "SLURM_JOB_ID": ""},
    )
    tree = _tree_when(PidTarget(proc.pid), 2)
    by_pid = tree.by_pid()
    assert by_pid[proc.pid].role == "main" and by_pid[proc.pid].rank == "0"
    worker = next(p for p in tree.processes if p.pid != proc.pid)
    assert (worker.role, worker.rank, worker.local_rank) == ("dataloader", "0", "0")
    assert tree.ranks() == ["0"]


def test_launcher_with_two_ranks_and_torchelastic_job_id(children) -> None:
    proc = children.python(LAUNCHER, env={"TORCHELASTIC_RUN_ID": "run-42"})
    tree = _tree_when(PidTarget(proc.pid), 5)
    roles = {p.pid: (p.role, p.rank) for p in tree.processes}
    assert roles[proc.pid] == ("launcher", "")
    assert tree.ranks() == ["0", "1"]
    assert sum(1 for r, _ in roles.values() if r == "dataloader") == 2
    assert {p.world_size for p in tree.mains()} == {"2"}
    assert tree.job_id == "run-42"


def test_attach_to_a_single_rank_of_a_launcher(children) -> None:
    proc = children.python(LAUNCHER, env={"SLURM_JOB_ID": "777"})
    full = _tree_when(PidTarget(proc.pid), 5)
    rank1 = next(p for p in full.mains() if p.rank == "1")
    tree = _tree_when(PidTarget(rank1.pid), 2)
    assert tree.ranks() == ["1"]
    assert tree.job_id == "777"


def test_plain_process_is_rank_zero_and_job_id_is_host_and_pid() -> None:
    unset = ("RANK", "SLURM_PROCID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
    clean = {k: v for k, v in os.environ.items() if k not in unset}
    plain = subprocess.Popen(SLEEPER, env=clean)
    try:
        tree = PidTarget(plain.pid).refresh()
        (only,) = tree.processes
        assert (only.role, only.rank, only.world_size) == ("main", "0", "1")
        assert tree.job_id == f"{socket.gethostname()}:{plain.pid}"  # a bare PID another node may share
    finally:
        plain.kill()
        plain.wait()


def test_workers_come_and_go(children, tmp_path: Path) -> None:
    flag = tmp_path / "spawn"
    proc = children.python(
        f"""
        import os, subprocess, sys, time
        while True:
            if os.path.exists({str(flag)!r}):
                os.remove({str(flag)!r})
                subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
            time.sleep(0.05)
        """,
        env={"RANK": "3"},
    )
    target = PidTarget(proc.pid)
    assert len(target.refresh().processes) == 1
    flag.touch()
    tree = _tree_when(target, 2)
    assert {p.role for p in tree.processes} == {"main", "dataloader"}
    wait_for(lambda: len(target.refresh().processes) == 1, what="worker exit")


def test_environ_unreadable_degrades_with_one_warning(children, caplog) -> None:
    proc = children.python(
        "import subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']); time.sleep(60)",
        env={"RANK": "5"},
    )

    def denied(root: Path, pid: int) -> dict[str, str]:
        raise PermissionError(13, "Permission denied")

    target = PidTarget(proc.pid, environ_reader=denied)
    with caplog.at_level("WARNING"):
        tree = _tree_when(target, 2)
        target.refresh()
    assert [p.rank for p in tree.mains()] == ["0"]  # falls back to a single-process job
    warnings = [r for r in caplog.records if "environ" in r.getMessage()]
    assert len(warnings) == 1


def test_tree_gone_after_kill(children) -> None:
    proc = children.python("import time; time.sleep(60)")
    target = PidTarget(proc.pid)
    assert target.refresh().alive
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    tree = target.refresh()
    assert not tree.alive and tree.processes == ()


def test_orphaned_rank_keeps_the_tree_alive(children) -> None:
    proc = children.python(
        "import subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)'], start_new_session=False); time.sleep(60)",
        env={"RANK": "0"},
    )
    target = PidTarget(proc.pid)
    tree = _tree_when(target, 2)
    worker = next(p.pid for p in tree.processes if p.pid != proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    tree = target.refresh()
    assert tree.alive and [p.pid for p in tree.processes] == [worker]
    os.kill(worker, signal.SIGKILL)
    wait_for(lambda: not psutil.pid_exists(worker) or psutil.Process(worker).status() == "zombie")
    time.sleep(0.1)
    assert not target.refresh().alive


def test_check_attachable_errors() -> None:
    with pytest.raises(UserError, match="no process with PID"):
        check_attachable(2**22 + 12345)
    assert check_attachable(os.getpid()).pid == os.getpid()


def test_between_full_scans_the_tree_is_walked_from_children_files(children, tmp_path: Path) -> None:
    """A child of a main thread is found at once, without a full scan; a child started by
    another thread is found at the next full scan, and its own children by the walk after."""
    main_flag, thread_flag = tmp_path / "main", tmp_path / "thread"
    proc = children.python(
        f"""
        import os, subprocess, sys, threading, time
        def spawn_from_a_thread():
            while not os.path.exists({str(thread_flag)!r}):
                time.sleep(0.05)
            code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
            subprocess.Popen([sys.executable, "-c", code])
            time.sleep(60)
        threading.Thread(target=spawn_from_a_thread, daemon=True).start()
        while not os.path.exists({str(main_flag)!r}):
            time.sleep(0.05)
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        time.sleep(60)
        """,
        env={"RANK": "0"},
    )
    now = [0.0]
    scans: list[int] = []
    target = PidTarget(proc.pid, clock=lambda: now[0])
    real_full_scan = target._full_scan
    target._full_scan = lambda roots: scans.append(1) or real_full_scan(roots)  # type: ignore[method-assign]
    assert len(target.refresh().processes) == 1 and len(scans) == 1
    main_flag.touch()
    assert len(_tree_when(target, 2).processes) == 2
    assert len(scans) == 1  # found by the walk: no second scan of the whole node

    thread_flag.touch()

    def threads_child_started() -> bool:
        return len(psutil.Process(proc.pid).children(recursive=True)) >= 3

    wait_for(threads_child_started, what="the thread's child and its grandchild")
    assert len(target.refresh().processes) == 2  # not seen by the walk: started by another thread
    now[0] += FULL_SCAN_EVERY
    tree = target.refresh()
    assert len(tree.processes) == 4 and len(scans) == 2  # the full scan finds both
    assert {p.role for p in tree.processes} == {"main", "dataloader"}, tree
    assert len(target.refresh().processes) == 4 and len(scans) == 2  # and the walk keeps them


def test_a_process_caught_before_exec_is_read_again_until_it_settles(children) -> None:
    """Between fork and exec a rank shows its launcher's environment: not cached then."""
    proc = children.python("import time; time.sleep(60)")
    born = psutil.Process(proc.pid).create_time()
    wall = [born + 0.01]
    envs = [{}, {"RANK": "3", "WORLD_SIZE": "4"}, {"RANK": "9"}]  # pre-exec, after exec, (never cached over)
    reads: list[int] = []

    def environ(_root: Path, pid: int) -> dict[str, str]:
        reads.append(pid)
        return envs[min(len(reads) - 1, len(envs) - 1)]

    target = PidTarget(proc.pid, environ_reader=environ, wall=lambda: wall[0])
    assert target.refresh().processes[0].rank == "0"  # no rank yet: the single-process default
    wall[0] = born + SETTLED_AFTER
    assert target.refresh().processes[0].rank == "3"  # read again: it has exec'd now
    assert target.refresh().processes[0].rank == "3" and len(reads) == 2  # settled: cached

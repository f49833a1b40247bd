"""The one /proc module: ``(proc_root, pid)`` everywhere, and a process table that agrees
with psutil on the live /proc and reads another root when given one."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

from profagent.system.procfs import (
    PF_EXITING,
    PROC,
    exited,
    process_table,
    read_environ,
    read_nspid,
    start_ticks,
)


def fake_proc(root: Path) -> Path:
    (root / "stat").write_text("cpu  1 2 3\nbtime 1700000000\n")
    for pid, ppid, state, argv in ((10, 1, "S", b"python\0train.py\0"), (11, 10, "Z", b""), (12, 10, "R", b"")):
        d = root / str(pid)
        d.mkdir()
        # the name holds a space and a parenthesis, as comm may
        (d / "stat").write_text(f"{pid} (py thon) x) {state} {ppid} " + " ".join(["0"] * 17) + " 250 0 0\n")
        (d / "cmdline").write_bytes(argv)
        (d / "environ").write_bytes(b"RANK=3\0WORLD_SIZE=4\0junk\0")
        (d / "status").write_text(f"Name:\tpython\nNSpid:\t{pid}\t7\n")
    (root / "self").mkdir()
    return root


def test_readers_take_the_root_then_the_pid(tmp_path: Path) -> None:
    root = fake_proc(tmp_path)
    assert read_environ(root, 10) == {"RANK": "3", "WORLD_SIZE": "4"}
    assert read_nspid(root, 10) == (10, 7)
    assert read_nspid(root, 99) == (99,)


def test_process_table_reads_the_given_root(tmp_path: Path) -> None:
    table = process_table(fake_proc(tmp_path))
    ticks = os.sysconf("SC_CLK_TCK")
    assert table == {10: (1, 250 / ticks + 1_700_000_000, "python train.py"), 12: (10, 250 / ticks + 1_700_000_000, "")}


def test_process_table_agrees_with_psutil() -> None:
    me = psutil.Process()
    ppid, created, cmdline = process_table(PROC)[me.pid]
    assert (ppid, created, cmdline) == (me.ppid(), me.create_time(), " ".join(me.cmdline()))


def _stat(root: Path, pid: int, state: str, flags: int, start: int) -> None:
    (root / str(pid)).mkdir()
    fields = [state, "1", "0", "0", "0", "0", str(flags)] + ["0"] * 12 + [str(start), "0", "0"]
    (root / str(pid) / "stat").write_text(f"{pid} (py thon) x) " + " ".join(fields) + "\n")


def test_exited_tells_a_live_process_from_one_gone_exiting_zombie_or_reused(tmp_path: Path) -> None:
    _stat(tmp_path, 20, "S", 0x400000, 500)  # alive (PF_RANDOMIZE and the like do not count)
    _stat(tmp_path, 21, "Z", 0, 500)  # exited, not reaped: psutil.pid_exists says True
    _stat(tmp_path, 22, "R", 0x400000 | PF_EXITING, 500)  # inside exit(), memory going away
    _stat(tmp_path, 23, "X", 0, 500)
    assert start_ticks(tmp_path, 20) == 500 and start_ticks(tmp_path, 99) is None
    assert not exited(tmp_path, 20) and not exited(tmp_path, 20, born=500)
    assert exited(tmp_path, 20, born=499)  # the PID now names another process
    assert exited(tmp_path, 21) and exited(tmp_path, 22) and exited(tmp_path, 23)
    assert exited(tmp_path, 99)  # no /proc entry


def test_exited_reads_the_live_proc() -> None:
    me = os.getpid()
    assert not exited(PROC, me, start_ticks(PROC, me))


def test_process_stats_agree_with_psutil() -> None:
    """One read of stat, status, io and the fd folder gives what psutil's six calls gave."""
    from profagent.system.procfs import read_identity, read_process_stats

    me = psutil.Process()
    time.sleep(0.01)  # a voluntary context switch at least: the parsed count cannot be a default 0
    before, ctx0 = me.cpu_times(), me.num_ctx_switches()
    st = read_process_stats(PROC, os.getpid())
    after, mem, ctx, io = me.cpu_times(), me.memory_info(), me.num_ctx_switches(), me.io_counters()
    assert before.user <= st.cpu_user <= after.user and before.system <= st.cpu_system <= after.system
    assert st.threads == me.num_threads() and st.cpu_iowait == before.iowait
    assert abs(st.rss - mem.rss) < 4 << 20  # a few pages may move between the two reads
    assert 0 < ctx0.voluntary <= st.ctx_voluntary <= ctx.voluntary
    assert ctx0.involuntary <= st.ctx_involuntary <= ctx.involuntary
    assert abs(st.fds - me.num_fds()) <= 1  # listing the folder holds one open
    assert st.read_bytes <= io.read_bytes and st.write_bytes <= io.write_bytes
    booted = psutil.boot_time()
    ppid, created = read_identity(PROC, os.getpid(), booted)
    assert ppid == os.getppid() and abs(created - me.create_time()) < 0.01


def test_identity_is_none_for_a_zombie_or_a_missing_process(tmp_path: Path) -> None:
    from profagent.system.procfs import read_identity

    root = fake_proc(tmp_path)
    assert read_identity(root, 10, 1700000000.0) == (1, 250 / os.sysconf("SC_CLK_TCK") + 1700000000.0)
    assert read_identity(root, 11, 0.0) is None  # zombie
    assert read_identity(root, 99, 0.0) is None  # gone


def test_process_stats_of_a_process_gone_raise_oserror(tmp_path: Path) -> None:
    import pytest

    from profagent.system.procfs import read_process_stats

    with pytest.raises(OSError):
        read_process_stats(fake_proc(tmp_path), 99)


def test_run_queue_is_the_main_threads_wait_for_a_cpu() -> None:
    """schedstat's second field (ns runnable, not running), of the thread-group leader."""
    from profagent.system.procfs import read_process_stats

    def waited() -> float:
        return int(Path(f"/proc/{os.getpid()}/schedstat").read_text().split()[1]) / 1e9

    before = waited()
    st = read_process_stats(PROC, os.getpid())
    assert st.run_queue is not None and before <= st.run_queue <= waited()


def test_run_queue_is_absent_where_schedstat_is_missing_or_unreadable(tmp_path: Path) -> None:
    from profagent.system.procfs import read_process_stats

    d = tmp_path / "10"
    (d / "fd").mkdir(parents=True)
    (d / "stat").write_text("10 (python) S 1 " + " ".join(["0"] * 45) + "\n")
    (d / "status").write_text("voluntary_ctxt_switches:\t3\nnonvoluntary_ctxt_switches:\t1\n")
    (d / "io").write_text("read_bytes: 0\nwrite_bytes: 0\n")
    assert read_process_stats(tmp_path, 10).run_queue is None  # a kernel without schedstats
    (d / "schedstat").write_text("garbage\n")
    assert read_process_stats(tmp_path, 10).run_queue is None
    (d / "schedstat").write_text("123 2500000000 7\n")
    assert read_process_stats(tmp_path, 10).run_queue == 2.5

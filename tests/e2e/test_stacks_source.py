"""The stacks source against real processes whose stacks we know (py-spy really runs)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import sysconfig
import time
from collections.abc import Callable

import psutil
import pytest

from helpers.processes import pyspy_processes, wait_for
from profagent.config import StacksConfig
from profagent.contracts import StacksSnapshot
from profagent.logs import PrintableFormatter
from profagent.sources.stacks.pyspy import target_python
from profagent.sources.stacks.source import StacksSource
from profagent.target import PidTarget

pytestmark = pytest.mark.slow


def make_source(**kw) -> StacksSource:
    cfg = StacksConfig(rate=50, window=1.0, stall_seconds=kw.pop("stall_seconds", 120.0), **kw)
    return StacksSource(cfg, interval=0.2, busy=kw.pop("busy", None) if "busy" in kw else None)


def pyspy_children() -> list[psutil.Process]:
    return pyspy_processes(of=os.getpid())


def run_until(source: StacksSource, pid: int, done: Callable[[StacksSnapshot], bool], timeout: float = 25.0) -> StacksSnapshot:
    """Collect on a fresh tree every 0.2 s until ``done(snapshot)``; fail on timeout."""
    target = PidTarget(pid)
    deadline = time.monotonic() + timeout
    snap = None
    while time.monotonic() < deadline:
        snap = source.collect(target.refresh())
        if done(snap):
            return snap
        time.sleep(0.2)
    pytest.fail(f"condition not met in {timeout}s; last snapshot: {snap}")


def group(snap: StacksSnapshot, rank: str = "0", role: str = "main"):
    return next((g for g in snap.groups if g.rank == rank and g.role == role), None)


def cats(snap: StacksSnapshot, rank: str = "0") -> dict[str, int]:
    g = group(snap, rank)
    return dict(g.categories) if g else {}


def funcs(snap: StacksSnapshot, rank: str = "0") -> dict[str, int]:
    g = group(snap, rank)
    return dict(g.functions) if g else {}


def wait_ready(proc, marker_path) -> None:
    deadline = time.monotonic() + 30
    while not os.path.exists(marker_path):
        assert proc.poll() is None, "child died"
        assert time.monotonic() < deadline, "child not ready"
        time.sleep(0.05)


HOT = """
import sys
def spin_in_named_function():
    x = 0
    while True:
        for i in range(1000):
            x += i
open(sys.argv[0] + ".ready", "w").close()
spin_in_named_function()
"""


def test_hot_loop_shows_up_as_the_top_function_and_threads_are_counted(children, tmp_path) -> None:
    proc = children.python(HOT)
    wait_ready(proc, str(tmp_path / "child_0.py.ready"))
    source = make_source()
    source.start()
    try:
        snap = run_until(source, proc.pid, lambda s: funcs(s).get("spin_in_named_function (child_0.py)", 0) >= 30
                         and group(s) is not None and group(s).threads)
    finally:
        source.stop()
    f = funcs(snap)
    assert max(f, key=f.get) == "spin_in_named_function (child_0.py)"
    assert cats(snap)["other"] >= 30 and cats(snap)["idle"] == 0
    states = {(s, g): n for s, g, n in group(snap).threads}
    assert states.get(("active", "held"), 0) >= 1
    assert snap.errors == ()


QUEUE = """
import queue, sys, threading, time
q = queue.Queue()
def producer():
    while True:
        time.sleep(5)
        q.put(1)
threading.Thread(target=producer, daemon=True).start()
def consume_forever():
    while True:
        q.get()
open(sys.argv[0] + ".ready", "w").close()
consume_forever()
"""


def test_main_thread_blocked_on_a_queue_is_idle(children, tmp_path) -> None:
    proc = children.python(QUEUE)
    wait_ready(proc, str(tmp_path / "child_0.py.ready"))
    source = make_source()
    source.start()
    try:
        snap = run_until(source, proc.pid, lambda s: cats(s).get("idle", 0) >= 40)
    finally:
        source.stop()
    c = cats(snap)
    assert c["idle"] >= 0.9 * sum(c.values())
    states = {(s, g): n for s, g, n in group(snap).threads}
    assert states.get(("idle", "not_held"), 0) >= 1


# A training loop that sleeps between steps (examples/train.py's --step-sleep).
SLEEPY = """
import sys, time
def train():
    x = 0
    while True:
        for i in range(2000):
            x += i
        time.sleep(0.05)
open(sys.argv[0] + ".ready", "w").close()
train()
"""


def test_a_sleep_in_the_training_loop_is_idle_not_the_loops_function(children, tmp_path) -> None:
    """py-spy samples the sleep as the loop's own line; once a dump saw that line idle, its
    samples count as idle (analysis/stacks.classify_with_idle). Dumps come every 15 s and
    py-spy may catch the thread waking, so this waits for a few of them."""
    proc = children.python(SLEEPY)
    wait_ready(proc, str(tmp_path / "child_0.py.ready"))
    source = make_source()
    source.start()
    try:
        snap = run_until(source, proc.pid, lambda s: cats(s).get("idle", 0) >= 40, timeout=120)
        before = cats(snap)
        snap = run_until(source, proc.pid, lambda s: sum(cats(s).values()) >= sum(before.values()) + 100, timeout=60)
    finally:
        source.stop()
    after = cats(snap)
    new = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert new["idle"] >= 0.6 * sum(new.values()), new  # the loop sleeps ~90% of the time


DATALOADER = """
import sys, time
import torch
from torch.utils.data import DataLoader, Dataset
class Slow(Dataset):
    def __len__(self):
        return 10**6
    def __getitem__(self, i):
        time.sleep(0.5)
        return torch.zeros(4)
loader = DataLoader(Slow(), batch_size=4, num_workers=2)
open(sys.argv[0] + ".ready", "w").close()
for batch in loader:
    batch.sum()
"""


def test_starved_dataloader_gives_dataloader_and_workers_are_attributed(children, tmp_path) -> None:
    proc = children.python(DATALOADER)
    wait_ready(proc, str(tmp_path / "child_0.py.ready"))
    source = make_source(dataloader=True)
    source.start()
    try:
        snap = run_until(source, proc.pid, lambda s: cats(s).get("dataloader", 0) >= 40
                         and group(s, role="dataloader") is not None
                         and sum(dict(group(s, role="dataloader").categories).values()) > 0, timeout=40)
    finally:
        source.stop()
    c = cats(snap)
    assert c["dataloader"] >= 0.8 * sum(c.values()), c
    workers = dict(group(snap, role="dataloader").categories)
    # worker main threads are sampled under role="dataloader": they run torch.utils.data's loop
    assert workers["dataloader"] >= 0.8 * sum(workers.values()), workers


ITEM = """
import sys
import torch
t = torch.randn(())
def call_item_in_a_loop():
    s = 0.0
    for _ in range(1000):
        s += t.item()
    return s
def call_cpu_synchronize():
    for _ in range(1000):
        torch.cpu.synchronize()
open(sys.argv[0] + ".ready", "w").close()
while True:
    call_item_in_a_loop()
    call_cpu_synchronize()
"""


def test_item_on_cpu_is_invisible_but_a_python_sync_call_is_host_sync(children, tmp_path) -> None:
    proc = children.python(ITEM)
    wait_ready(proc, str(tmp_path / "child_0.py.ready"))
    source = make_source()
    source.start()
    try:
        snap = run_until(source, proc.pid, lambda s: funcs(s).get("call_item_in_a_loop (child_0.py)", 0) >= 20
                         and cats(s).get("host_sync", 0) >= 5, timeout=30)
    finally:
        source.stop()
    f = funcs(snap)
    # .item() is a C method: its samples land on the calling Python function, category other
    assert not any(name.startswith(("item ", "Tensor.item")) for name in f)
    assert cats(snap)["other"] >= f["call_item_in_a_loop (child_0.py)"]
    # torch.cpu.synchronize() is a Python function, so the host_sync rule sees it
    assert f.get("synchronize (__init__.py)", 0) >= 5


LAUNCHER = """
import os, subprocess, sys
code = '''
import os, sys
def work_of_rank_{r}():
    while True:
        sum(range(1000))
open(sys.argv[1], "w").close()
work_of_rank_{r}()
'''
procs = []
for r in (0, 1):
    env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", TORCHELASTIC_RUN_ID="job42")
    procs.append(subprocess.Popen([sys.executable, "-c", code.format(r=r), sys.argv[0] + f".ready{r}"], env=env))
for p in procs:
    p.wait()
"""


def test_launcher_with_two_ranks_attributes_each_rank(children, tmp_path) -> None:
    proc = children.python(LAUNCHER)
    for r in (0, 1):
        wait_ready(proc, str(tmp_path / f"child_0.py.ready{r}"))
    source = make_source()
    source.start()
    try:
        snap = run_until(source, proc.pid, lambda s: funcs(s, "0").get("work_of_rank_0 (<string>)", 0) >= 20
                         and funcs(s, "1").get("work_of_rank_1 (<string>)", 0) >= 20)
    finally:
        source.stop()
    assert snap.job_id == "job42"
    assert "work_of_rank_1 (<string>)" not in funcs(snap, "0")
    assert "work_of_rank_0 (<string>)" not in funcs(snap, "1")
    assert {g.role for g in snap.groups} == {"main"}  # the launcher is not sampled


def test_target_killed_mid_window_gives_no_errors_and_no_leftover(children, tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="profagent")
    proc = children.python(HOT)
    wait_ready(proc, str(tmp_path / "child_0.py.ready"))
    source = make_source()
    source.start()
    target = PidTarget(proc.pid)
    try:
        tree = target.refresh()
        deadline = time.monotonic() + 10
        while not pyspy_children():
            assert time.monotonic() < deadline, "py-spy never started"
            source.collect(tree)
            time.sleep(0.05)
        time.sleep(0.3)  # mid-window
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        end = time.monotonic() + 2.5
        while time.monotonic() < end:
            snap = source.collect(tree)  # a stale tree on purpose: the agent may lag
            time.sleep(0.1)
        assert snap.errors == ()
        assert pyspy_children() == []
    finally:
        source.stop()
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert noisy == []


def test_a_rank_left_a_zombie_is_gone_not_a_failure(children, tmp_path, caplog) -> None:
    """Issue 23: an exited rank that nobody has reaped yet still has a PID, so the sampler
    used to read it (and count py-spy's error on it). Now: no py-spy is started on it once
    it is a zombie, nothing is counted, nothing is logged as a warning."""
    caplog.set_level(logging.INFO, logger="profagent")
    proc = children.python(HOT)
    wait_ready(proc, str(tmp_path / "child_0.py.ready"))
    source = make_source()
    source.start()
    try:
        tree = PidTarget(proc.pid).refresh()
        deadline = time.monotonic() + 10
        while not pyspy_children():
            assert time.monotonic() < deadline, "py-spy never started"
            source.collect(tree)
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # not reaped: a zombie while the test runs
        wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE, what="the rank to be a zombie")
        wait_for(lambda: not pyspy_children() and source.collect(tree) is not None, what="the in-flight py-spy to end")
        launched = source._sampler._seq  # py-spy runs started so far (a failing one lives ms)
        end = time.monotonic() + 7.0  # past RETRY_AFTER (5 s), when a failed run is retried
        while time.monotonic() < end:
            snap = source.collect(tree)  # the stale tree still lists the zombie
            time.sleep(0.05)
        assert snap.errors == () and source._sampler._seq == launched
        assert psutil.pid_exists(proc.pid)  # still unreaped: the case psutil.pid_exists got wrong
    finally:
        source.stop()
        proc.wait()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_stop_leaves_no_py_spy_and_the_target_running(children, tmp_path) -> None:
    proc = children.python(HOT)
    wait_ready(proc, str(tmp_path / "child_0.py.ready"))
    for blocking in (False, True):
        # A 30 s window: a stop() that waited for the window to end instead of stopping
        # py-spy would take 30 s, so the generous bound below still tells the two apart.
        source = StacksSource(StacksConfig(rate=50, window=30.0, nonblocking=not blocking), interval=0.2)
        source.start()
        tree = PidTarget(proc.pid).refresh()
        deadline = time.monotonic() + 10
        while not pyspy_children():  # a record window is running
            assert time.monotonic() < deadline, "py-spy never started"
            source.collect(tree)
            time.sleep(0.02)
        began = time.monotonic()
        source.stop()
        assert time.monotonic() - began < 10.0
        assert pyspy_children() == []
        assert psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED


STUCK = """
import sys, threading
def stuck_here():
    threading.Event().wait()
open(sys.argv[0] + ".ready", "w").close()
stuck_here()
"""


def test_stall_is_flagged_once_with_frames_unless_gpus_are_busy(children, tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="profagent")
    proc = children.python(STUCK)
    wait_ready(proc, str(tmp_path / "child_0.py.ready"))
    busy = StacksSource(StacksConfig(rate=20, window=1.0, stall_seconds=2.0), 0.2, busy=lambda rank, job: True)
    idle = StacksSource(StacksConfig(rate=20, window=1.0, stall_seconds=2.0), 0.2, busy=lambda rank, job: False)
    for s in (busy, idle):
        s.start()
    try:
        target = PidTarget(proc.pid)
        snaps: dict = {}

        def both_stalled_long_enough(_: object) -> bool:
            tree = target.refresh()
            snaps["busy"] = busy.collect(tree)
            snaps["idle"] = idle.collect(tree)
            return all(s.stalls and s.stalls[0].unchanged_seconds > 3.5 for s in snaps.values())

        run_until(idle, proc.pid, both_stalled_long_enough, timeout=30)
        snap, busy_snap = snaps["idle"], snaps["busy"]
    finally:
        for s in (busy, idle):
            s.stop()
    assert snap.stalls[0].stalled and snap.stalls[0].unchanged_seconds > 2.0
    assert busy_snap.stalls and not busy_snap.stalls[0].stalled
    assert busy_snap.stalls[0].unchanged_seconds > 2.0
    records = [r for r in caplog.records if "stalled" in r.getMessage()]
    assert len(records) == 1
    # the stack, one frame a line under the message, as the agent's log prints it
    text = PrintableFormatter("%(message)s").format(records[0]).splitlines()
    assert "its GPUs idle" in text[0] and "    stuck_here (child_0.py:4)" in text[1:], text


def test_target_python_is_read_from_proc(children, tmp_path) -> None:
    proc = children.python(HOT)
    wait_ready(proc, str(tmp_path / "child_0.py.ready"))
    build = target_python(proc.pid)
    # the child runs this interpreter (3.10+ is supported, whichever the venv has)
    assert build is not None and (build.major, build.minor) == sys.version_info[:2]
    assert build.free_threaded == bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def test_ptrace_denial_is_fatal_only_for_a_process_never_read() -> None:
    from profagent.sources.stacks.sampler import Result

    source = StacksSource(StacksConfig())
    source._fold(Result("record", 5, "0", "main", 0.0, 1.0, 1.0))
    source._fold(Result("record", 5, "0", "main", 1.0, 2.0, 2.0, error="permission", detail="Permission Denied"))
    assert source._fatal == "" and source._errors == {("", "permission"): 1}
    source._fold(Result("record", 6, "1", "main", 1.0, 2.0, 2.0, error="permission"))
    assert "ptrace denied on PID 6" in source._fatal and "CAP_SYS_PTRACE" in source._fatal
    source._fold(Result("record", 7, "2", "main", 1.0, 2.0, 2.0, error="target_gone"))
    assert source._errors == {("", "permission"): 1}  # a process exiting is not an error


def test_sampler_errors_belong_to_their_job_and_leave_with_it() -> None:
    """Watch mode: a failed py-spy run is counted under its process's job, and the count
    goes when the job does; a failure of no job (the sampler's own) stays."""
    from profagent.contracts import ProcessInfo, ProcessTree
    from profagent.sources.stacks.sampler import Result

    def tree(*jobs: str) -> ProcessTree:
        procs = tuple(ProcessInfo(100 + i, 1, 0.0, "main", "0", "0", "1", "python", job_id=j)
                      for i, j in enumerate(jobs))
        return ProcessTree("", 1, procs, True, tuple((j, True) for j in jobs))

    source = StacksSource(StacksConfig())
    source._targets(tree("a", "b"))
    source._fold(Result("record", 100, "0", "main", 0.0, 1.0, 1.0, error="pyspy_failed"))
    source._fold(Result("dump", 101, "0", "main", 0.0, 1.0, 1.0, error="parse"))
    source._fold(Result("record", 0, "", "", 0.0, 1.0, 1.0, error="OSError"))
    assert source._snapshot("").errors == (("", "OSError", 1), ("a", "pyspy_failed", 1), ("b", "parse", 1))
    source._forget_ended_jobs(tree("b"))
    assert source._snapshot("").errors == (("", "OSError", 1), ("b", "parse", 1))

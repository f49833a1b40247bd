"""sources/stacks/pyspy.py: locating py-spy, mapping its failures, stopping children, the doctor check."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers.processes import wait_for
from profagent.config import Config, StacksConfig
from profagent.doctor.stacks import check_pyspy
from profagent.sources.stacks import pyspy
from profagent.sources.stacks.sampler import TORN_READS_TOLERATED, Sampler
from profagent.system.procfs import PROC, start_ticks

# What py-spy 0.4 prints when a non-blocking dump races an interpreter that is still
# starting up (seen against a python just spawned, and in the watch churn test).
TORN_STDERR = """Error: Failed to get stack traces

Caused by:
    0: Failed to call get_stack_trace for thread 140124002208640
    1: Failed to copy PyCodeObject
    2: Bad address (os error 14)
"""


# What py-spy 0.4 prints when it reads a rank that is exiting (its memory already unmapped).
DATA_SECTION_STDERR = "Error: Failed to find a python interpreter in the .data section\n"


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
    assert pyspy.failure_reason(TORN_STDERR, me) == "torn_read"
    # a rank exiting (#24): retried at once, unreported, and gone by the next read
    exiting = "Error: Failed to find a python interpreter in the .data section"
    assert pyspy.failure_reason(exiting, me) == "torn_read"
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE, 30, what="a zombie")
    assert pyspy.failure_reason(exiting, zombie.pid) == "target_gone"
    zombie.wait()
    assert pyspy.failure_reason("anything at all", dead.pid) == "target_gone"
    me_born = start_ticks(PROC, me)
    # alive: an interpreter not set up yet (or torn down): read again at once, and only three
    # such reads in a row count as pyspy_failed (tests/e2e/test_stacks_source.py)
    assert pyspy.failure_reason(DATA_SECTION_STDERR, me, me_born) == "torn_read"
    assert pyspy.failure_reason(DATA_SECTION_STDERR, me, me_born + 1) == "target_gone"  # PID reused
    assert pyspy.first_line("\npy-spy> Sampling\nError: boom\nStack backtrace:\n 0: x") == "Error: boom"


def test_a_zombie_target_is_gone_not_a_pyspy_failure() -> None:
    """An exited, unreaped rank still has a PID (psutil.pid_exists is True): what py-spy
    says about it, e.g. the .data section error of a target whose memory is unmapped, is
    the target going away (watch churn test: 3 flaky runs in 7 counted it as pyspy_failed)."""
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        wait_for(lambda: psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE,
                 what="the child to exit unreaped")
        assert psutil.pid_exists(zombie.pid)
        assert pyspy.failure_reason(DATA_SECTION_STDERR, zombie.pid) == "target_gone"
        res = subprocess.run(pyspy.dump_args(pyspy.find_pyspy(), zombie.pid, True), capture_output=True, text=True,
                             timeout=60)
        assert res.returncode != 0 and pyspy.failure_reason(res.stderr, zombie.pid) == "target_gone"
    finally:
        zombie.wait()


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


@pytest.mark.parametrize("setpriv", [True, False], ids=["setpriv", "preexec"])
def test_spawned_children_die_with_their_parent(setpriv: bool) -> None:
    """PR_SET_PDEATHSIG: a py-spy child does not outlive an agent killed with SIGKILL, set by
    setpriv (the agent is vforked) or, without it, by a preexec function."""
    code = (
        "import sys, time\n"
        "from profagent.sources.stacks import pyspy\n"
        + ("" if setpriv else "pyspy.SETPRIV_PATHS = ()\n") +
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


@pytest.mark.parametrize("setpriv", [True, False], ids=["setpriv", "preexec"])
def test_a_spawned_child_has_sigkill_as_its_parent_death_signal(tmp_path: Path, monkeypatch, setpriv: bool) -> None:
    if not setpriv:
        monkeypatch.setattr(pyspy, "SETPRIV_PATHS", ())
    pyspy.lifeline.cache_clear()
    try:
        assert bool(pyspy.lifeline()) == (setpriv and any(os.path.exists(p) for p in pyspy.SETPRIV_PATHS))
        out = tmp_path / "out"
        code = ("import ctypes, os; v = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); "
                "print(v.value, os.getsid(0) == os.getpid())")  # PR_GET_PDEATHSIG = 2
        child = pyspy.spawn([sys.executable, "-c", code], stdout_path=out)
        assert child.wait(60) == 0
        assert out.read_text().split() == [str(int(signal.SIGKILL)), "True"]  # and in its own session
    finally:
        pyspy.lifeline.cache_clear()


def test_setpriv_is_taken_from_fixed_root_owned_places_only(tmp_path: Path, monkeypatch) -> None:
    planted = tmp_path / "setpriv"
    planted.write_text("#!/bin/sh\nexit 0\n")
    planted.chmod(0o777)  # anyone may rewrite it: never run as root
    monkeypatch.setattr(pyspy, "SETPRIV_PATHS", (str(planted),))
    monkeypatch.setenv("PATH", str(tmp_path))
    pyspy.lifeline.cache_clear()
    try:
        assert pyspy.lifeline() == ()
    finally:
        pyspy.lifeline.cache_clear()


def test_doctor_check_reports_py_spy_and_a_live_dump() -> None:
    rows = {r.name: r for r in check_pyspy(Config())}
    assert rows["py-spy"].status == "ok"
    assert rows["ptrace policy"].status in ("ok", "warn", "fail")
    assert rows["py-spy dump"].status == "ok", rows["py-spy dump"]


def _scripted_pyspy(tmp_path: Path, torn_dumps: int) -> tuple[Path, Path]:
    """A stand-in py-spy: its first ``torn_dumps`` dumps fail with py-spy's torn-read
    error, later ones print an empty thread list; a record window just waits to be stopped.
    Every dump appends a line to the returned log."""
    log = tmp_path / "dumps.log"
    script = tmp_path / "py-spy"
    script.write_text(f"""#!{sys.executable}
import sys, time
if sys.argv[1] == "dump":
    with open({str(log)!r}, "a") as fh:
        fh.write("dump\\n")
    n = sum(1 for _ in open({str(log)!r}))
    if n <= {torn_dumps}:
        sys.stderr.write({TORN_STDERR!r})
        sys.exit(1)
    print("[]")
else:
    time.sleep(60)
""")
    script.chmod(0o755)
    return script, log


def _drain_until(sampler: Sampler, done, what: str, timeout: float = 20.0) -> list:
    got: list = []

    def ready() -> bool:
        got.extend(sampler.drain())
        return bool(done(got))

    try:
        wait_for(ready, timeout=timeout, what=what)
    except pytest.fail.Exception as exc:  # say what did come, and what still runs
        running = {k: (c.window, c.cut_at, c.native) for k, c in sampler._children.items()}
        raise AssertionError(f"{exc}; results: {[(r.kind, r.native, r.error, r.detail) for r in got]}; "
                             f"running (window, cut at, native): {running}") from None
    return got


def test_a_few_torn_dumps_are_retried_at_once_and_not_reported(children, tmp_path: Path) -> None:
    torn = TORN_READS_TOLERATED - 1
    binary, log = _scripted_pyspy(tmp_path, torn_dumps=torn)
    target = children.python("import time; time.sleep(60)")
    sampler = Sampler(str(binary), StacksConfig(window=1.0))
    sampler.start()
    try:
        sampler.set_targets({target.pid: ("0", "main")})
        got = _drain_until(sampler, lambda rs: any(r.kind == "dump" and not r.error for r in rs),
                           "a clean dump after the torn ones")
    finally:
        sampler.stop()
    assert len(log.read_text().splitlines()) == torn + 1  # the torn ones were really read, then retried
    assert [r for r in got if r.error] == []


def test_torn_dumps_that_never_stop_are_reported_as_a_failure(children, tmp_path: Path) -> None:
    binary, log = _scripted_pyspy(tmp_path, torn_dumps=10**6)
    target = children.python("import time; time.sleep(60)")
    sampler = Sampler(str(binary), StacksConfig(window=1.0))
    sampler.start()
    try:
        sampler.set_targets({target.pid: ("0", "main")})
        got = _drain_until(sampler, lambda rs: any(r.error for r in rs), "the torn reads reported")
    finally:
        sampler.stop()
    errors = [r for r in got if r.error]
    assert len(log.read_text().splitlines()) == TORN_READS_TOLERATED
    assert [(r.kind, r.error) for r in errors] == [("dump", "pyspy_failed")]
    assert errors[0].detail.startswith(f"{TORN_READS_TOLERATED} torn reads in a row: Error: Failed to get stack traces")


def test_a_steady_window_is_cut_short_when_its_process_needs_the_full_pace(children) -> None:
    """A stall suspected during a steady window: the rank's next look, and a native window
    asked of it, come now, not when the steady window would have ended (here never)."""
    target = children.python("import time\nwhile True:\n    time.sleep(0.01)\n")
    binary = pyspy.find_pyspy()
    # a readable interpreter first: a py-spy that fails on a Python still starting is
    # retried after 5 s, then 10 s... (RETRY_AFTER), which is not what this test is about
    wait_for(lambda: "<module>" in subprocess.run(pyspy.dump_text_args(binary, target.pid, "nonblocking"),
                                                  capture_output=True, text=True, timeout=30).stdout,
             60, what="the target's interpreter readable")
    sampler = Sampler(binary, StacksConfig(rate=20, window=1.0))
    sampler.start()
    try:
        sampler.set_pace({target.pid: (4, 3600.0)})
        sampler.set_targets({target.pid: ("0", "main")})
        wait_for(lambda: ("record", target.pid) in sampler._children, what="the steady window running")
        assert sampler._children[("record", target.pid)].window == 3600
        sampler.request_native(target.pid)
        sampler.set_pace({target.pid: (20, 1.0)})
        # generous: the claim is "not after the steady window's 3600 s", and a native window
        # on a node loaded by the rest of the suite may take seconds (20 s was once too short)
        got = _drain_until(sampler, lambda rs: any(r.kind == "record" and r.native for r in rs),
                           "the native window, after the steady one was cut", timeout=90.0)
    finally:
        sampler.stop()
    records = [r for r in got if r.kind == "record"]
    assert [r for r in got if r.error] == []
    assert records[-1].native and sum(s.count for s in records[-1].samples) > 0
    assert all(r.samples for r in records)  # the cut window kept what it had sampled (or gave nothing)


def test_a_cut_window_whose_pyspy_ignores_sigint_is_killed_and_the_next_one_runs_at_the_new_pace(
        children, tmp_path: Path) -> None:
    """SIGINT is lost when it comes before py-spy set its handler in a process that ignores
    SIGINT (inherited from an agent a shell started in the background): the cut
    window is killed after CUT_GRACE, not left to run its 3600 s."""
    binary = tmp_path / "py-spy"  # a record that ignores SIGINT, says so, and waits to be killed
    ignoring = tmp_path / "ignoring-sigint"
    binary.write_text(f"#!{sys.executable}\nimport signal, sys, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                      f"print('[]') if sys.argv[1] == 'dump' else (open({str(ignoring)!r}, 'w').close(), "
                      "time.sleep(3600))\n")
    binary.chmod(0o755)
    target = children.python("import time\nwhile True:\n    time.sleep(0.01)\n")
    sampler = Sampler(str(binary), StacksConfig(rate=20, window=1.0))
    sampler.start()
    try:
        sampler.set_pace({target.pid: (4, 3600.0)})
        sampler.set_targets({target.pid: ("0", "main")})
        steady = wait_for(lambda: sampler._children.get(("record", target.pid)), what="the steady window running")
        assert steady.window == 3600
        # cut only once the fake ignores SIGINT: before that, SIGINT kills it (CI run of 7118e7c)
        wait_for(ignoring.exists, 30, what="the steady window's py-spy ignoring SIGINT")
        sampler.set_pace({target.pid: (20, 1.0)})
        wait_for(lambda: steady.proc.returncode is not None, 30, what="the cut window killed")
        nxt = wait_for(lambda: (c := sampler._children.get(("record", target.pid))) is not steady and c, 30,
                       what="the next window")
    finally:
        sampler.stop()
    assert steady.proc.returncode == -signal.SIGKILL and nxt.window == 1
    assert [r for r in sampler.drain() if r.error] == []  # a cut window that gave nothing is no failure


def test_a_pyspy_that_misses_its_deadline_is_killed_counted_backed_off_then_its_process_skipped(
        children, tmp_path: Path, monkeypatch) -> None:
    """Issue 41 item 1: a py-spy blocked for good (here a fake that sleeps; in the attack, an
    open() of a planted FIFO) is killed at its deadline and its slot freed; after
    LATE_RUNS_BEFORE_SKIP late runs in a row its process is skipped, with its reason, while
    another process on the same single slot keeps being sampled."""
    import profagent.sources.stacks.sampler as sampler_module

    monkeypatch.setattr(sampler_module, "DEADLINE_SLACK", 3.0)  # a real py-spy on a loaded machine needs its time
    monkeypatch.setattr(sampler_module, "DUMP_DEADLINE", 3.0)
    monkeypatch.setattr(sampler_module, "RETRY_AFTER", 0.2)
    real = pyspy.find_pyspy()
    binary = tmp_path / "py-spy"  # hangs on the stuck process, is the real py-spy for the other
    stuck = children.python("import time\nwhile True:\n    time.sleep(0.01)\n")
    healthy = children.python("import time\nwhile True:\n    sum(range(3000)); time.sleep(0.01)\n")
    binary.write_text(f"#!{sys.executable}\nimport os, sys, time\n"
                      f"if {str(stuck.pid)!r} in sys.argv:\n    time.sleep(3600)\n"
                      f"os.execv({real!r}, [{real!r}, *sys.argv[1:]])\n")
    binary.chmod(0o755)
    sampler = Sampler(str(binary), StacksConfig(rate=20, window=1.0, max_pyspy=2))
    sampler.start()
    got = []
    try:
        sampler.set_targets({stuck.pid: ("0", "main"), healthy.pid: ("1", "main")})
        got = _drain_until(sampler, lambda rs: any(r.error == "pyspy_skipped" for r in rs), "the stuck process skipped",
                           timeout=90.0)
        # then the healthy one has both slots: its windows go on
        more = _drain_until(sampler, lambda rs: sum(1 for r in rs if r.kind == "record" and r.samples) >= 2,
                            "the healthy process' next windows", timeout=60.0)
        skipped_at = next(r.end for r in got if r.error == "pyspy_skipped")  # when it was skipped
        started_after = [c for c in sampler._children.values() if c.pid == stuck.pid and c.start > skipped_at]
    finally:
        sampler.stop()
    late = [r for r in got if r.error == "pyspy_deadline"]
    assert {r.pid for r in late} == {stuck.pid}
    assert len(late) >= sampler_module.LATE_RUNS_BEFORE_SKIP
    assert all("deadline: killed" in r.detail for r in late)
    assert started_after == []  # nothing started on it after the skip
    # only the other kind's run, started before the skip, may still end (late) afterwards
    assert [r.error for r in more if r.pid == stuck.pid] in ([], ["pyspy_deadline"])
    assert any(r.pid == healthy.pid and r.samples for r in got + more)
    assert stuck.poll() is None and healthy.poll() is None  # neither target harmed
    assert pyspy_processes_left(binary) == []


def pyspy_processes_left(binary: Path) -> list[int]:
    """PIDs of processes still running the fake py-spy script."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if str(binary) in (p.info["cmdline"] or []):
            found.append(p.pid)
    return found

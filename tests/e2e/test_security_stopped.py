"""Blocking py-spy never resumes a target someone else stopped (a Slurm suspend), and never
leaves a running one stopped. Real child, real py-spy, real SIGSTOP."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from profagent.config import StacksConfig
from profagent.sources.stacks import pyspy
from profagent.sources.stacks.sampler import Result, Sampler

pytestmark = pytest.mark.slow

HOT = """
import sys
def spin():
    x = 0
    while True:
        x += 1
open(sys.argv[0] + ".ready", "w").close()
spin()
"""


def _ready(proc, marker: Path) -> None:
    deadline = time.monotonic() + 30
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "child not ready"
        time.sleep(0.05)


def _wait_stopped(pid: int, stopped: bool) -> None:
    deadline = time.monotonic() + 10
    while (psutil.Process(pid).status() == psutil.STATUS_STOPPED) != stopped:
        assert time.monotonic() < deadline, f"PID {pid} never became {'stopped' if stopped else 'running'}"
        time.sleep(0.02)


def _record_windows(sampler: Sampler, pid: int, count: int) -> list[Result]:
    """Drain until ``count`` record windows on ``pid`` finished: proof the sampler looked."""
    got: list[Result] = []
    deadline = time.monotonic() + 40
    while sum(r.kind == "record" and r.pid == pid and r.error != "target_resumed" for r in got) < count:
        assert time.monotonic() < deadline, f"no record window finished: {got}"
        time.sleep(0.1)
        got.extend(sampler.drain())
    return got


def _blocking_sampler() -> Sampler:
    return Sampler(pyspy.find_pyspy(), StacksConfig(rate=50, window=1.0, nonblocking=False))


def test_a_suspended_target_stays_suspended_after_blocking_windows(children, tmp_path: Path) -> None:
    proc = children.python(HOT)
    _ready(proc, tmp_path / "child_0.py.ready")
    os.kill(proc.pid, signal.SIGSTOP)  # as `scontrol suspend` does
    _wait_stopped(proc.pid, True)
    sampler = _blocking_sampler()
    sampler.start()
    try:
        sampler.set_targets({proc.pid: ("0", "main")})
        results = _record_windows(sampler, proc.pid, 2)
        assert psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED
    finally:
        sampler.stop()
    assert not [r for r in results if r.error == "target_resumed"]
    # stop() ran the resume path for any live child too: still stopped, well after the windows
    time.sleep(0.5)
    assert psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED
    os.kill(proc.pid, signal.SIGCONT)  # the "scheduler" resumes it: it runs again
    _wait_stopped(proc.pid, False)


def test_a_running_target_is_never_left_stopped(children, tmp_path: Path) -> None:
    proc = children.python(HOT)
    _ready(proc, tmp_path / "child_0.py.ready")
    sampler = _blocking_sampler()
    sampler.start()
    try:
        sampler.set_targets({proc.pid: ("0", "main")})
        results = _record_windows(sampler, proc.pid, 2)
        assert any(r.samples for r in results), results
    finally:
        sampler.stop()
    assert psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED


def test_resume_only_what_we_stopped(children, tmp_path: Path) -> None:
    """The primitive: a target left in T by a killed py-spy is resumed, a pre-stopped one is not."""
    proc = children.python(HOT)
    _ready(proc, tmp_path / "child_0.py.ready")
    assert not pyspy.is_stopped(proc.pid)
    os.kill(proc.pid, signal.SIGSTOP)  # stands for a py-spy SIGKILLed mid-sample
    _wait_stopped(proc.pid, True)
    assert pyspy.is_stopped(proc.pid)
    assert pyspy.resume_if_stopped(proc.pid, stopped_before=True) is False
    time.sleep(0.2)
    assert psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED
    assert pyspy.resume_if_stopped(proc.pid, stopped_before=False) is True
    _wait_stopped(proc.pid, False)

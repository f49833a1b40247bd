"""The py-spy sampler's sleep between steps: until a run is due, a child ends or MAX_WAIT."""

from __future__ import annotations

from pathlib import Path

import pytest

from profagent.config import StacksConfig
from profagent.sources.stacks.sampler import MAX_WAIT, POLL, PySpyChild, Sampler


def _sampler(now: list[float], max_pyspy: int = 16) -> Sampler:
    return Sampler("py-spy", StacksConfig(max_pyspy=max_pyspy), clock=lambda: now[0])


def _child(kind: str, pid: int, pidfd: int | None) -> PySpyChild:
    return PySpyChild(kind, pid, "0", "main", None, Path("out"), Path("err"), 0.0, 0.0, pidfd=pidfd)  # type: ignore[arg-type]


def test_it_sleeps_until_the_next_dump_is_due_waking_on_the_running_windows() -> None:
    now = [100.0]
    s = _sampler(now)
    s._wanted = {1: ("0", "main"), 2: ("1", "main")}
    s._children = {("record", 1): _child("record", 1, 7), ("record", 2): _child("record", 2, 8)}
    s._next = {("dump", 1): 100.4, ("dump", 2): 103.0}
    fds, timeout = s._sleep_plan()
    assert sorted(fds) == [7, 8] and timeout == pytest.approx(0.4)


def test_nothing_due_for_long_sleeps_max_wait_and_something_due_now_polls() -> None:
    now = [100.0]
    s = _sampler(now)
    s._wanted = {1: ("0", "main")}
    s._children = {("record", 1): _child("record", 1, 7)}
    s._next = {("dump", 1): 200.0}
    assert s._sleep_plan()[1] == MAX_WAIT
    s._next = {("dump", 1): 50.0}  # due, not started (the process was exiting): look again soon
    assert s._sleep_plan()[1] == POLL


def test_runs_deferred_by_the_cap_wait_for_a_child_to_end() -> None:
    now = [100.0]
    s = _sampler(now, max_pyspy=1)
    s._wanted = {1: ("0", "main"), 2: ("1", "main")}
    s._children = {("record", 1): _child("record", 1, 7)}
    s._next = {("dump", 1): 200.0, ("dump", 2): 200.0}
    s._deferred = {("record", 2)}  # due now, but the one slot is taken: the child's exit wakes us
    assert s._sleep_plan() == ([7], MAX_WAIT)


def test_without_pidfds_it_polls() -> None:
    now = [0.0]
    s = _sampler(now)
    s._wanted = {1: ("0", "main")}
    s._children = {("record", 1): _child("record", 1, None)}
    s._next = {("dump", 1): 50.0}
    assert s._sleep_plan() == ([], POLL)

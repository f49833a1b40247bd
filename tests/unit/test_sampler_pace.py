"""The py-spy sampler's pace: a window longer than its process' new pace is cut short."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from profagent.config import StacksConfig
from profagent.sources.stacks import sampler as sampler_module
from profagent.sources.stacks.sampler import CUT_GRACE, PySpyChild, Sampler


class FakeProc:
    def __init__(self, pid: int, returncode: int | None = None) -> None:
        self.pid, self.returncode = pid, returncode


@pytest.fixture
def signalled(monkeypatch) -> list[tuple[int, int]]:
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(sampler_module.pyspy, "interrupt",
                        lambda proc, sig=signal.SIGINT: sent.append((proc.pid, sig)))
    return sent


def _child(kind: str, pid: int, window: int, tmp: Path | None = None, native: bool = False) -> PySpyChild:
    tmp = tmp or Path("/nonexistent")
    return PySpyChild(kind, pid, "0", "main", FakeProc(1000 + pid), tmp / f"{pid}.out", tmp / f"{pid}.err",  # type: ignore[arg-type]
                      0.0, 0.0, native=native, window=window)


def _sampler(now: list[float]) -> Sampler:
    return Sampler("py-spy", StacksConfig(rate=20, window=2.0, steady_rate=4, steady_window=20.0),
                   clock=lambda: now[0])


def test_a_steady_window_is_cut_once_when_its_process_turns_to_the_full_pace(signalled) -> None:
    now = [0.0]
    s = _sampler(now)
    children = {("record", 1): _child("record", 1, 20), ("record", 2): _child("record", 2, 20),
                ("record", 3): _child("record", 3, 2), ("dump", 1): _child("dump", 1, 0)}
    s.set_pace({1: (4, 20.0), 2: (4, 20.0), 3: (20, 2.0)})
    s._cut_slow_windows(children)
    assert signalled == []  # every window runs at its pace

    s.set_pace({1: (20, 2.0), 2: (4, 20.0), 3: (20, 2.0)})  # a stall suspected in rank 1's job
    s._cut_slow_windows(children)
    now[0] = CUT_GRACE - 0.1
    s._cut_slow_windows(children)  # the next steps, until its py-spy has exited
    assert signalled == [(1001, signal.SIGINT)]  # rank 1's steady window, once; not the dump, not the others
    assert children[("record", 1)].cut_at == 0.0 and children[("record", 2)].cut_at is None

    now[0] = CUT_GRACE  # SIGINT lost (ignored before py-spy set its handler): killed
    s._cut_slow_windows(children)
    assert signalled == [(1001, signal.SIGINT), (1001, signal.SIGKILL)]

    s.set_pace({})  # a process not named gets the full pace
    s._cut_slow_windows(children)
    assert signalled[-1] == (1002, signal.SIGINT)


def test_setting_a_new_pace_wakes_the_sampler_and_the_same_pace_does_not(monkeypatch) -> None:
    s = _sampler([0.0])
    woken: list[bool] = []
    monkeypatch.setattr(s._waiter, "wake", lambda: woken.append(True))
    s.set_pace({1: (4, 20.0)})
    s.set_pace({1: (4, 20.0)})
    s.set_pace({1: (20, 2.0)})
    assert woken == [True, True]


def test_a_window_cut_before_it_sampled_is_no_failure_and_a_native_one_is_asked_again(tmp_path: Path) -> None:
    now = [50.0]
    s = _sampler(now)
    for native in (False, True):
        child = _child("record", 7, 20, tmp_path, native=native)
        child.proc.returncode = -2  # type: ignore[misc]  # SIGINT before py-spy's handler was set
        child.cut_at = 40.0
        child.out.write_text("")
        child.err.write_text("")
        assert s._harvest(child, now[0]) == []  # no error reported, nothing to fold
        assert s._next[("record", 7)] == now[0]  # the next window, at the new pace, at once
        assert (7 in s._native) is native


def test_a_cut_window_with_samples_is_harvested_as_a_window(tmp_path: Path) -> None:
    s = _sampler([50.0])
    child = _child("record", 7, 20, tmp_path)
    child.proc.returncode = 0  # type: ignore[misc]
    child.cut_at = 40.0
    child.out.write_text("thread (7);<module> (train.py:5);step (train.py:9) 3\n")
    child.err.write_text("")
    [result] = s._harvest(child, 53.0)
    assert not result.error and (result.start, result.end) == (0.0, 53.0)
    assert sum(x.count for x in result.samples) == 3

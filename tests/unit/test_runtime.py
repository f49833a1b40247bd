"""The runtime isolates sources: errors are counted, logged once, and never stop the others."""

from __future__ import annotations

import logging
import os
import threading

from helpers.processes import wait_for
from profagent.engine.runtime import Runtime
from profagent.errors import SourceError, SourceUnavailable, SourceWaiting
from profagent.exporters.exposition import Exposition
from profagent.state import State
from profagent.target import PidTarget


class Counting:
    name = "counting"
    interval = 0.1

    def __init__(self) -> None:
        self.ticks = 0
        self.stopped = False

    def start(self) -> None: ...

    def collect(self, tree):
        self.ticks += 1
        return self.ticks

    def stop(self) -> None:
        self.stopped = True


class Failing(Counting):
    name = "failing"

    def collect(self, tree):
        self.ticks += 1
        if self.ticks % 2:
            raise SourceError("device went away", reason="device_lost")
        raise ValueError("boom")


class Unavailable(Counting):
    name = "unavailable"

    def start(self) -> None:
        raise SourceUnavailable("no NVIDIA driver found: GPU metrics off")


class Slow(Counting):
    """A tick that takes far longer than any scrape may wait."""

    name = "slow"
    interval = 0.1

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.in_tick = False

    def collect(self, tree):
        self.ticks += 1
        self.in_tick = True
        self.release.wait()
        self.in_tick = False
        return self.ticks


def _runtime(*sources) -> tuple[Runtime, State]:
    state = State()
    rt = Runtime(PidTarget(os.getpid()), list(sources), state, interval=0.1)
    rt.start()
    return rt, state


def test_failing_source_is_counted_logged_once_and_isolated(caplog) -> None:
    ok, bad = Counting(), Failing()
    with caplog.at_level(logging.WARNING):
        rt, state = _runtime(ok, bad)
        try:
            wait_for(lambda: bad.ticks >= 6 and ok.ticks >= 6, what="ticks")
        finally:
            rt.stop()
    health = state.view().health
    assert health["failing"].errors["device_lost"] >= 3
    assert health["failing"].errors["ValueError"] >= 2
    assert health["counting"].up and not health["counting"].errors
    assert state.view().snapshots["counting"] >= 6
    messages = [r.getMessage() for r in caplog.records]
    assert sum("device went away" in m for m in messages) == 1
    assert sum("boom" in m for m in messages) == 1


def test_unavailable_source_is_off_with_reason_and_others_run() -> None:
    ok, off = Counting(), Unavailable()
    rt, state = _runtime(off, ok)
    try:
        wait_for(lambda: ok.ticks >= 3, what="ticks")
    finally:
        rt.stop()
    health = state.view().health["unavailable"]
    assert not health.up and "no NVIDIA driver" in health.detail
    text = Exposition(state.view).render("")[0].decode()
    assert 'profagent_collector_up{collector="unavailable"} 0.0' in text
    assert 'profagent_collector_up{collector="counting"} 1.0' in text


def test_scrape_never_waits_on_a_source_and_stop_is_prompt() -> None:
    """Both happen while the slow tick is still blocked, so neither waited on it (no clock)."""
    slow = Slow()
    rt, state = _runtime(slow)
    exposition = Exposition(state.view)
    wait_for(lambda: slow.ticks >= 1, what="slow tick started")
    body = exposition.render("")[0]
    assert b"profagent_target_up" in body and slow.in_tick
    stopper = threading.Thread(target=rt.stop)
    stopper.start()
    stopper.join(timeout=60)  # the tick stays blocked until released below: only a hang fails
    assert not stopper.is_alive() and slow.stopped and slow.in_tick
    slow.release.set()


class Waiting(Counting):
    """Starts without what it needs (an endpoint another process holds), retries, gets it."""

    name = "waiting"

    def __init__(self) -> None:
        super().__init__()
        self.free = threading.Event()

    def start(self) -> None:
        raise SourceWaiting("the endpoint is held by PID 7 of uid 65534", "endpoint_held")

    def collect(self, tree):
        self.ticks += 1
        if not self.free.is_set():
            raise SourceWaiting("the endpoint is held by PID 7 of uid 65534", "endpoint_held")
        return self.ticks


def test_a_waiting_source_is_off_with_its_reason_keeps_ticking_and_comes_on() -> None:
    """Issue 51 high 5: a source that waits for its endpoint is registered and off
    (collector_up 0, profagent_collector_retrying 1) while its loop runs, with no error
    counted per tick; its first snapshot turns it on."""
    waiting = Waiting()
    rt, state = _runtime(waiting)
    try:
        wait_for(lambda: waiting.ticks >= 3, what="the waiting source's ticks")
        health = state.view().health["waiting"]
        assert not health.up and health.retrying == "endpoint_held" and "PID 7" in health.detail
        assert not health.errors
        text = Exposition(state.view).render("")[0].decode()
        assert 'profagent_collector_up{collector="waiting"} 0.0' in text
        assert 'profagent_collector_retrying{collector="waiting",reason="endpoint_held"} 1.0' in text
        waiting.free.set()
        wait_for(lambda: state.view().health["waiting"].up, what="the source on")
    finally:
        rt.stop()
    health = state.view().health["waiting"]
    assert health.retrying == "" and health.detail == ""
    assert 'profagent_collector_retrying{' not in Exposition(state.view).render("")[0].decode()

"""The CPU account: work charged by the thread clock, children by their rusage."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from profagent.system.cputime import CpuAccount, reap


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_charge_adds_the_thread_clock_spent_in_the_block() -> None:
    clock = FakeClock()
    cpu = CpuAccount(thread_clock=clock)
    with cpu.charge("traces"):
        clock.now += 0.3
    with cpu.charge("traces"):
        clock.now += 0.2
    with cpu.charge("host"):
        clock.now += 0.1
    assert cpu.totals() == pytest.approx({"traces": 0.5, "host": 0.1})
    assert cpu.children() == {}


def test_charge_counts_a_block_that_raises() -> None:
    clock = FakeClock()
    cpu = CpuAccount(thread_clock=clock)
    with pytest.raises(ValueError), cpu.charge("gpu"):
        clock.now += 0.25
        raise ValueError("nvml")
    assert cpu.totals() == {"gpu": 0.25}


def test_children_count_in_their_collector_and_apart() -> None:
    cpu = CpuAccount(thread_clock=FakeClock())
    cpu.add("stacks", 0.5)
    cpu.add_child("stacks", 2.0)
    cpu.add_child("stacks", 0.0)  # nothing to add
    assert cpu.totals() == {"stacks": 2.5}
    assert cpu.children() == {"stacks": 2.0}


def test_concurrent_charges_are_not_lost() -> None:
    cpu = CpuAccount(thread_clock=FakeClock())

    def work() -> None:
        for _ in range(1000):
            cpu.add("http", 0.001)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cpu.totals()["http"] == pytest.approx(8.0)


def test_reap_returns_a_real_childs_cpu_and_its_exit_status() -> None:
    # The child burns CPU until its own CPU clock says 0.3 s (not wall time: load cannot shorten it).
    code = "import time\nwhile time.process_time() < 0.3: pass\nraise SystemExit(3)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    seconds = None
    while seconds is None:
        seconds = reap(proc)
        if seconds is None:
            time.sleep(0.01)  # polling for the exit; Popen.wait() would reap it and lose its rusage
    assert proc.returncode == 3
    assert seconds >= 0.3
    assert reap(proc) == 0.0  # reaped once: nothing more to charge

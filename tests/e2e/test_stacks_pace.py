"""py-spy's pace: the full rate while a process warms up or someone watches, the steady rate
otherwise (what a node pays for stacks, issue #26)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from helpers.agent import free_port, http_get
from helpers.processes import pyspy_processes, wait_for
from profagent.config import StacksConfig
from profagent.sources.stacks.pace import WATCH_HOLD
from profagent.sources.stacks.source import StacksSource

JOB = """
import time
def work():
    return sum(range(50000))
while True:
    work()
    time.sleep(0.01)
"""


def _record_rates(agent_pid: int, job_pid: int) -> set[str]:
    rates = set()
    for p in pyspy_processes(of=agent_pid, sampling=job_pid):
        try:
            args = p.cmdline()
        except psutil.Error:
            continue
        if "record" in args:
            rates.add(args[args.index("--rate") + 1])
    return rates


@pytest.mark.slow
def test_steady_after_warmup_and_full_rate_while_watched(children, run_agent, tmp_path: Path) -> None:
    job = children.python(JOB, env={"RANK": "0", "WORLD_SIZE": "1"})
    config = tmp_path / "pace.toml"
    config.write_text("[stacks]\nrate = 20\nwindow = 1\nsteady_rate = 4\nsteady_window = 2\nwarmup_seconds = 3\n"
                      "[findings]\nenabled = false\n")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    agent = run_agent(["attach", "--pid", str(job.pid), "--listen", f"127.0.0.1:{port}", "--config", str(config)])
    agent.wait_healthy(base)
    pid = agent.proc.pid
    wait_for(lambda: "20" in _record_rates(pid, job.pid), timeout=30, what="a full-rate window while warming up")
    wait_for(lambda: "4" in _record_rates(pid, job.pid), timeout=60, what="a steady-rate window after warm-up")
    http_get(base + "/api/stacks?rank=0&seconds=10")  # someone looks: full rate again
    wait_for(lambda: "20" in _record_rates(pid, job.pid), timeout=30, what="a full-rate window while watched")


def test_pace_policy() -> None:
    """Full rate: warm-up, a stall suspected in the job, a finding on the job, someone watching."""
    now = [0.0]
    hot_jobs: set[str] = set()
    source = StacksSource(StacksConfig(rate=20, window=5, steady_rate=4, steady_window=20, warmup_seconds=60),
                          clock=lambda: now[0])
    source.job_hot = lambda job: job in hot_jobs
    source._job_of = {1: ("a", 0.0), 2: ("a", 0.0), 3: ("b", 0.0)}
    wanted = {1: ("0", "main"), 2: ("1", "main"), 3: ("0", "main")}
    full, steady = (20, 5), (4, 20)
    assert source._pace(wanted) == {1: full, 2: full, 3: full}  # warming up
    now[0] = 60.0
    assert source._pace(wanted) == {1: steady, 2: steady, 3: steady}
    source._stall_state[("a", "1")] = (False, 20.0, ())  # rank 1 of job a: one unchanged stack
    # every rank of job a (the hang verdict reads each as it is now), not job b
    assert source._pace(wanted) == {1: full, 2: full, 3: steady}
    hot_jobs.add("b")
    assert source._pace(wanted) == {1: full, 2: full, 3: full}
    source._stall_state[("a", "1")] = (False, 0.0, ())
    hot_jobs.clear()
    source.watched()
    assert source._pace(wanted) == {1: full, 2: full, 3: full}
    now[0] += WATCH_HOLD
    assert source._pace({**wanted, 4: ("2", "main")}) == {1: steady, 2: steady, 3: steady, 4: full}  # 4 is new
    source.config = StacksConfig(steady_rate=0)
    assert set(source._pace(wanted).values()) == {(20, 5.0)}  # steady_rate 0: always the full rate


def test_a_broken_findings_hook_never_breaks_stacks() -> None:
    source = StacksSource(StacksConfig(warmup_seconds=0), clock=lambda: 100.0)
    source.job_hot = lambda job: 1 / 0
    assert source._pace({1: ("0", "main")}) == {1: (4, 20.0)}


def test_only_a_fresh_finding_keeps_the_full_rate() -> None:
    from types import SimpleNamespace

    from profagent.contracts import Finding, FindingsSnapshot
    from profagent.engine.agent import FRESH_FINDING, Job
    from profagent.state import State

    state = State()
    job = SimpleNamespace(state=state)
    assert not Job.has_findings(job, "j")  # no findings engine tick yet
    new = Finding("straggler", "j", "1", "warning", "rank 1 is slow", since=1000.0)
    state.publish("findings", FindingsSnapshot((new,), time=1000.0 + FRESH_FINDING - 1), 0.0)
    assert Job.has_findings(job, "j") and not Job.has_findings(job, "other")
    state.publish("findings", FindingsSnapshot((new,), time=1000.0 + FRESH_FINDING), 0.0)
    assert not Job.has_findings(job, "j")  # established: the steady pace keeps tracking it

"""The agent's CPU, per collector, on a real job: py-spy counted under stacks, nothing invented."""

from __future__ import annotations

import pytest

from helpers.agent import free_port, http_get, parse_metrics
from helpers.processes import wait_for

JOB = """
import time
x = 0
while True:
    for i in range(100000):
        x += i
    time.sleep(0.01)
"""


def _by_collector(text: str) -> dict[str, float]:
    return {lab["collector"]: v for lab, v in parse_metrics(text).get("profagent_collector_cpu_seconds_total", [])}


@pytest.mark.slow
def test_cpu_per_collector_covers_pyspy_and_stays_within_the_process(children, run_agent) -> None:
    job = children.python(JOB, env={"RANK": "0", "WORLD_SIZE": "1"})
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    agent = run_agent(["attach", "--pid", str(job.pid), "--listen", f"127.0.0.1:{port}", "--interval", "0.2"])
    agent.wait_healthy(base)

    def pyspy_counted() -> str:
        text = http_get(base + "/metrics")
        pyspy = parse_metrics(text).get("profagent_pyspy_cpu_seconds_total", [])
        cpu = _by_collector(text)
        return text if pyspy and pyspy[0][1] > 0 and cpu.get("host", 0) > 0 and cpu.get("http", 0) > 0 else ""

    text = wait_for(pyspy_counted, timeout=60, what="the CPU of py-spy, the host collector and the HTTP server (these scrapes) to be counted")
    metrics = parse_metrics(text)
    cpu = _by_collector(text)
    pyspy = metrics["profagent_pyspy_cpu_seconds_total"][0][1]
    own = metrics["process_cpu_seconds_total"][0][1]  # the agent process alone, children not included
    assert set(cpu) <= {"target", "host", "gpu", "stacks", "traces", "ondemand", "timeline", "findings", "incidents", "http"}
    assert cpu["stacks"] >= pyspy > 0  # py-spy's children are the stacks collector's cost
    # What is charged in the agent's own threads is part of the process's CPU (10 ms ticks of slack).
    assert sum(cpu.values()) - pyspy <= own + 0.05

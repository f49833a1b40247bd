"""The pytest fixtures: real child processes, a real agent subprocess, a real Prometheus.

Plain helpers live in tests/helpers/ (this file's folder is on sys.path, so tests import
them as ``helpers.*``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helpers.agent import AgentProcess
from helpers.processes import Children
from helpers.prometheus import Prometheus


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Children]:
    kids = Children(tmp_path)
    yield kids
    kids.cleanup()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files marked ``slow_first`` (minutes each) go first among files of as many tests:
    xdist's loadfile hands out the files with the most tests first and keeps this order
    among equals. Longest-first was slower: the CPU-heavy jobs then ran together and, on
    2 cores, slowed one another."""
    items.sort(key=lambda item: item.get_closest_marker("slow_first") is None)


AGENT_LOG_LINES_ON_FAILURE = 60
CALL_FAILED = pytest.StashKey[bool]()  # the test's call phase failed (for fixtures' teardown)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    return report


@pytest.fixture
def run_agent(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., AgentProcess]]:
    agents: list[AgentProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> AgentProcess:
        agent = AgentProcess(args, tmp_path, env)
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        agent.stop()
    if request.node.stash.get(CALL_FAILED, False):  # the agents' own account, in the failure's report
        for agent in agents:
            tail = agent.output.splitlines()[-AGENT_LOG_LINES_ON_FAILURE:]
            print(f"--- agent {' '.join(agent.proc.args[3:6])} (PID {agent.proc.pid}), last lines of its log ---",
                  *tail, sep="\n")


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[..., Prometheus]]:
    servers: list[Prometheus] = []

    def start(targets: list[str], scheme: str = "http") -> Prometheus:
        server = Prometheus(targets, tmp_path, scheme)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()

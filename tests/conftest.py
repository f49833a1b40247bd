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
    """Files marked ``slow_first(seconds)`` run first, the longest first: xdist hands files
    out in this order (``--no-loadscope-reorder`` in pyproject.toml; its default would put
    files of many short tests first), and a long file started last would leave the other
    workers idle at the end. The sort is stable: a file's tests keep their order."""

    def seconds(item: pytest.Item) -> float:
        mark = item.get_closest_marker("slow_first")
        return 0.0 if mark is None else float(mark.args[0]) if mark.args else 60.0

    items.sort(key=lambda item: -seconds(item))


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

"""The pytest fixtures: real child processes, a real agent subprocess, a real Prometheus.

Plain helpers live in tests/helpers/ (this file's folder is on sys.path, so tests import
them as ``helpers.*``).
"""

from __future__ import annotations

import collections
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
    """The order xdist hands out files in (``make test`` turns its own reordering off):
    files marked ``slow_first`` first, then the end-to-end files with the most tests first,
    as xdist would, and the unit files last. A file of one or two long tests would otherwise
    start last and be the suite's tail; the unit files, seconds each, fill the workers' ends
    instead. Only a few files carry the mark: handing out every long file first was slower,
    as their CPU-heavy jobs then ran together and, on 2 cores, slowed one another."""
    per_file = collections.Counter(item.path for item in items)
    items.sort(key=lambda item: (item.get_closest_marker("slow_first") is None, item.path.parent.name == "unit",
                                 -per_file[item.path]))


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

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


@pytest.fixture
def run_agent(tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    agents: list[AgentProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> AgentProcess:
        agent = AgentProcess(args, tmp_path, env)
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        agent.stop()


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

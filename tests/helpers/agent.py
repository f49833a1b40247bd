"""A real `profagent` subprocess and what it serves: ports, HTTP, the Prometheus text format."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.processes import stop_process, wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> str:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read().decode()


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)], from the Prometheus text format."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def wait_for_ticks(url: str, collector: str, ticks: int = 2, timeout: float = 30.0) -> None:
    """Wait until the agent at ``url`` has finished ``ticks`` more successful ticks of
    ``collector`` (its ``collector_last_success`` timestamp moved that many times): proof the
    agent looked again, before a test asserts that nothing changed."""
    def last_success() -> float | None:
        metrics = parse_metrics(http_get(url + "/metrics"))
        rows = metrics.get("profagent_collector_last_success_timestamp_seconds", [])
        return next((v for labels, v in rows if labels.get("collector") == collector), None)

    seen = [last_success()]

    def moved() -> bool:
        now = last_success()
        if now is not None and now != seen[-1]:
            seen.append(now)
        return len(seen) > ticks

    wait_for(moved, timeout, interval=0.1, what=f"{ticks} more {collector} ticks")


class AgentProcess:
    """`profagent ARGS` as a real subprocess, with its output captured to a file."""

    def __init__(self, args: list[str], tmp: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = tmp / f"agent-{time.monotonic_ns()}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "profagent", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # its own state folder unless the test names one: as root the default is
            # /var/lib/profagent, where trace offsets and incident bundles would stay behind
            env={"PROFAGENT_STATE_DIR": str(tmp / "state"), **os.environ, **(env or {})},
        )

    @property
    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, url: str, timeout: float = 20.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"agent exited early ({self.proc.returncode}):\n{self.output}")
            return http_get(url + "/healthz", timeout=1).strip() == "ok"

        wait_for(ready, timeout, what="agent /healthz")

    def stop(self) -> int:
        stop_process(self.proc)
        self._log.close()
        return self.proc.returncode

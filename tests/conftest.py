"""Shared fixtures: real child processes, a real agent subprocess, a real Prometheus."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
# The shared fixtures sit next to the checkout, or further up for a git worktree.
SHARED_TRACES = next(
    (d / "shared" / "traces" / "gpu" for d in ROOT.parents if (d / "shared" / "traces" / "gpu").is_dir()),
    ROOT.parent / "shared" / "traces" / "gpu",
)
WORKLOADS = Path(__file__).resolve().parent / "workloads"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout: float = 15.0, interval: float = 0.1, what: str = "condition"):
    """Poll until predicate() is truthy; return its value or fail the test."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # not ready yet
            last_exc = exc
        time.sleep(interval)
    pytest.fail(f"timed out waiting for {what} (last error: {last_exc})")


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


def pyspy_processes(of: int | None = None, sampling: int | None = None, zombies: bool = False) -> list:
    """The py-spy processes descending from PID ``of`` (None: anywhere on the machine, so an
    orphan that outlived its agent is found too), only those sampling PID ``sampling`` if
    given; zombies (exited, not yet reaped) only when asked."""
    import psutil

    procs = psutil.process_iter() if of is None else psutil.Process(of).children(recursive=True)
    found = []
    for p in procs:
        try:
            if p.name() != "py-spy" or (not zombies and p.status() == psutil.STATUS_ZOMBIE):
                continue
            if sampling is not None and str(sampling) not in p.cmdline():
                continue
            found.append(p)
        except psutil.Error:
            continue
    return found


def kill_tree(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGKILL a child and every descendant, then reap them.

    The process group is not enough: torchrun starts each rank in its own session. So the
    tree is frozen first (SIGSTOP, top down, until no new descendant appears: a stopped
    process cannot fork), then every process found is killed, and all are waited for.
    """
    try:
        root = psutil.Process(proc.pid)
    except psutil.Error:
        root = None
    tree: dict[int, psutil.Process] = {}
    frontier = [root] if root is not None else []
    while frontier:
        found: list[psutil.Process] = []
        for p in frontier:
            with contextlib.suppress(psutil.Error):
                p.suspend()
            tree.setdefault(p.pid, p)
            with contextlib.suppress(psutil.Error):
                found += [c for c in p.children(recursive=True) if c.pid not in tree]
        frontier = found
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(proc.pid) == proc.pid:  # started with start_new_session=True
            os.killpg(proc.pid, signal.SIGKILL)
    for p in tree.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    psutil.wait_procs([p for pid, p in tree.items() if pid != proc.pid], timeout=timeout)


class Children:
    """Real child processes started by a test, all killed (with their trees) afterwards."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def python(self, code: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        script = self.tmp / f"child_{len(self.procs)}.py"
        script.write_text(textwrap.dedent(code))
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen([sys.executable, str(script)], env=full_env, start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        for proc in self.procs:
            kill_tree(proc)


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Children]:
    kids = Children(tmp_path)
    yield kids
    kids.cleanup()


class AgentProcess:
    """`profagent ARGS` as a real subprocess, with its output captured to a file."""

    def __init__(self, args: list[str], tmp: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = tmp / f"agent-{time.monotonic_ns()}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "profagent", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


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


class Prometheus:
    """A real Prometheus server on 127.0.0.1 scraping the given targets every second."""

    def __init__(
        self, targets: list[str], tmp: Path, scheme: str = "http", rule_files: Sequence[Path] = (),
        data_dir: Path | None = None, args: Sequence[str] = (),
    ) -> None:
        """``rule_files`` are loaded too, evaluated every second like the scrape. ``data_dir``:
        an existing TSDB to serve (backfilled blocks), instead of a fresh one; ``args``: more
        command-line flags (e.g. ``--storage.tsdb.retention.time``)."""
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus is not installed: `make test` installs Debian's package")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = tmp / "prometheus.yml"
        targets_yaml = ", ".join(f"'{t}'" for t in targets)
        rules = "".join(f"  - '{path}'\n" for path in rule_files)
        cfg.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            + (f"rule_files:\n{rules}" if rules else "")
            + "scrape_configs:\n  - job_name: profagent\n"
            f"    scheme: {scheme}\n    static_configs:\n      - targets: [{targets_yaml}]\n"
        )
        data = data_dir if data_dir is not None else Path(tempfile.mkdtemp(dir=tmp, prefix="prom-data-"))
        self.log_path = tmp / "prometheus.log"
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={data}",
             f"--web.listen-address=127.0.0.1:{self.port}", *args],
            stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT,
        )
        wait_for(lambda: http_get(self.url + "/-/ready", timeout=1), 30, what="prometheus ready")

    def query(self, expr: str) -> list[dict]:
        import json
        from urllib.parse import quote

        body = json.loads(http_get(f"{self.url}/api/v1/query?query={quote(expr)}"))
        assert body["status"] == "success", body
        return body["data"]["result"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


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


def promtool_check_metrics(text: str) -> str:
    """Run `promtool check metrics` on an exposition; returns what it printed (empty = clean)."""
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is not installed: `make test` installs Debian's prometheus package")
    res = subprocess.run([binary, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
    return (res.stdout + res.stderr).decode().strip()

"""sd_notify: READY, WATCHDOG, RELOADING, STOPPING arrive on a NOTIFY_SOCKET the test binds."""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from pathlib import Path

import pytest

from helpers.agent import free_port
from helpers.processes import wait_for
from helpers.watch import token, watch_config
from profagent.system.sdnotify import Notifier


class NotifySocket:
    """A datagram socket standing in for systemd's notify socket; collects every message."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self.sock.settimeout(0.2)
        self.address = address
        self.messages: list[dict[str, str]] = []

    def poll(self) -> list[dict[str, str]]:
        try:
            while True:
                data = self.sock.recv(4096).decode()
                self.messages.append(dict(line.split("=", 1) for line in data.splitlines() if "=" in line))
                self.sock.settimeout(0.01)
        except (TimeoutError, BlockingIOError):
            self.sock.settimeout(0.2)
        return self.messages

    def count(self, key: str, value: str = "1") -> int:
        return sum(1 for m in self.poll() if m.get(key) == value)

    def index(self, key: str, value: str = "1", start: int = 0) -> int:
        for i, m in enumerate(self.poll()[start:], start):
            if m.get(key) == value:
                return i
        return -1

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request, tmp_path: Path):
    if request.param == "path":
        address = str(tmp_path / "notify.sock")
    else:
        address = f"@profagent-test-{uuid.uuid4().hex}"
    sock = NotifySocket(address)
    yield sock
    sock.close()


def test_notifier_outside_systemd_is_a_no_op() -> None:
    n = Notifier.from_env({})
    assert n.address is None and n.watchdog_interval is None
    assert n.ready() is False and n.watchdog() is False


def test_notifier_watchdog_interval_is_half_and_respects_watchdog_pid() -> None:
    env = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "30000000"}
    assert Notifier.from_env(env).watchdog_interval == 15.0
    assert Notifier.from_env({**env, "WATCHDOG_PID": str(os.getpid())}).watchdog_interval == 15.0
    assert Notifier.from_env({**env, "WATCHDOG_PID": "1"}).watchdog_interval is None
    assert Notifier.from_env({"NOTIFY_SOCKET": "vsock:2:9"}).address is None  # unsupported: skipped


def test_notifier_sends_to_both_kinds_of_socket(notify_socket: NotifySocket) -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": notify_socket.address})
    assert n.ready("serving") and n.reloading() and n.stopping()
    msgs = wait_for(lambda: len(notify_socket.poll()) >= 3 and notify_socket.messages, what="3 datagrams")
    assert msgs[0] == {"READY": "1", "STATUS": "serving"}
    assert msgs[1]["RELOADING"] == "1" and int(msgs[1]["MONOTONIC_USEC"]) > 0
    assert msgs[2] == {"STOPPING": "1"}


@pytest.mark.slow
def test_watch_sends_ready_watchdog_reload_and_stopping(notify_socket, run_agent, tmp_path) -> None:
    port = free_port()
    cfg = watch_config(tmp_path, token())
    began = time.monotonic()
    agent = run_agent(["watch", "--config", str(cfg), "--listen", f"127.0.0.1:{port}"],
                      env={"NOTIFY_SOCKET": notify_socket.address, "WATCHDOG_USEC": "600000"})
    wait_for(lambda: notify_socket.count("READY"), timeout=30, what="READY=1")
    agent.wait_healthy(f"http://127.0.0.1:{port}", timeout=5)  # READY means serving already
    ready = next(m for m in notify_socket.messages if m.get("READY") == "1")
    assert "watching 0 jobs" in ready.get("STATUS", "")

    # WATCHDOG_USEC = 0.6 s: pings every 0.3 s; ask for several in a row.
    wait_for(lambda: notify_socket.count("WATCHDOG") >= 4, timeout=20, what="WATCHDOG=1 pings")
    assert time.monotonic() - began < 30

    start = len(notify_socket.poll())
    agent.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: notify_socket.index("RELOADING", start=start) >= 0, what="RELOADING=1")
    reloading = notify_socket.index("RELOADING", start=start)
    wait_for(lambda: notify_socket.index("READY", start=reloading) > reloading, what="READY=1 after the reload")

    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=10) == 0
    wait_for(lambda: notify_socket.count("STOPPING"), timeout=5, what="STOPPING=1")
    assert "Traceback" not in agent.output


class RecordingNotifier(Notifier):
    def __init__(self) -> None:
        super().__init__("@unused", watchdog_usec=100_000)  # ping every 0.05 s
        self.sent: list[tuple[str, ...]] = []

    def send(self, *fields: str) -> bool:
        self.sent.append(fields)
        return True


def test_watchdog_pings_only_while_discovery_refreshes(tmp_path, caplog) -> None:
    """A stuck discovery loop stops the pings, so systemd restarts the agent."""
    import io
    import logging
    import threading

    from rich.console import Console

    from profagent.config import load_config
    from profagent.engine.node import NodeDaemon

    cfg = load_config(watch_config(tmp_path, token()), overrides={"listen": "127.0.0.1:0"})
    notifier = RecordingNotifier()
    watcher = NodeDaemon(cfg, lambda: cfg, notifier, Console(file=io.StringIO()))
    caplog.set_level(logging.WARNING, logger="profagent.engine.node")
    # _loop, not run(): run() starts the runtime, and this test needs discovery never to refresh
    loop = threading.Thread(target=watcher._loop, daemon=True)  # starts the watchdog thread
    loop.start()  # the runtime is not started: discovery never refreshes
    try:
        # the loop reached a ping time and decided (its warning says so): only then check it did not ping
        wait_for(lambda: any("not pinging the watchdog" in r.getMessage() for r in caplog.records), 20,
                 what="the loop deciding not to ping a stuck discovery")
        assert not [f for f in notifier.sent if "WATCHDOG=1" in f]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum("WATCHDOG=1" in f for f in notifier.sent) < 3:
            watcher.target.last_refresh = time.monotonic()  # discovery is alive again
            time.sleep(0.05)
        assert sum("WATCHDOG=1" in f for f in notifier.sent) >= 3
    finally:
        watcher.stop_event.set()
        loop.join(5)

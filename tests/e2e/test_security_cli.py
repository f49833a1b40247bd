"""Item 16: bad --url values, a FIFO as --web-config, and an existing folder named as the
on-demand trace folder, each through the real CLI."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.agent import AgentProcess, free_port
from profagent.cli.client import parse_agent_url
from profagent.errors import UserError

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profagent", *args], capture_output=True, text=True, timeout=120, env=ENV)


def _one_line_exit_2(res: subprocess.CompletedProcess, *words: str) -> None:
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    for word in words:
        assert word in res.stderr, res.stderr


@pytest.mark.parametrize("command", [["diagnose"], ["top", "--once"], ["incidents", "list"], ["incidents", "show", "x"]])
def test_bad_url_is_one_line_exit_2(command: list[str]) -> None:
    _one_line_exit_2(_cli(*command, "--url", "http://[::1"), "http://[::1", "Invalid IPv6 URL")


@pytest.mark.parametrize("url", ["http://[::1", "http://h:abc", "http://h:99999", "http://[zz]:1", "ftp://h", "http://",
                                 "http://h:1/\x1b[2J", "http://h :1"])
def test_parse_agent_url_refuses(url: str) -> None:
    with pytest.raises(UserError) as exc:
        parse_agent_url(url)
    assert "\n" not in str(exc.value) and "\x1b" not in str(exc.value)


def test_parse_agent_url_accepts() -> None:
    assert parse_agent_url("127.0.0.1:19400").geturl() == "http://127.0.0.1:19400"
    assert parse_agent_url("https://[::1]:19400/metrics").port == 19400


def test_fifo_as_web_config_does_not_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "web.yml"
    os.mkfifo(fifo)  # nobody ever writes to it: opening it for reading would block forever
    res = _cli("attach", "--pid", str(os.getpid()), "--listen", "127.0.0.1:0", "--no-stacks", "--web-config", str(fifo))
    _one_line_exit_2(res, str(fifo), "not a regular file")
    link = tmp_path / "link.yml"
    (tmp_path / "real.yml").write_text("{}\n")
    link.symlink_to(tmp_path / "real.yml")
    _one_line_exit_2(_cli("attach", "--pid", str(os.getpid()), "--listen", "127.0.0.1:0", "--no-stacks",
                          "--web-config", str(link)), "symbolic link", str(tmp_path / "real.yml"))


def test_existing_folder_as_trace_dir_keeps_its_mode(tmp_path: Path) -> None:
    """Root's own folder (as /etc would be) named as ondemand.trace_dir or socket_dir is used
    as it is, with one warning line, and never chmod-ed; one the agent creates gets 1777."""
    etc_like, sockets = tmp_path / "etc-like", tmp_path / "sockets"
    etc_like.mkdir(mode=0o755)
    sockets.mkdir(mode=0o700)
    before = {p: stat.S_IMODE(p.stat().st_mode) for p in (etc_like, sockets)}
    port = free_port()
    agent = AgentProcess(["attach", "--pid", str(os.getpid()), "--listen", f"127.0.0.1:{port}", "--no-stacks"], tmp_path,
                         env={"PROFAGENT_ONDEMAND_TRACE_DIR": str(etc_like), "PROFAGENT_ONDEMAND_SOCKET_DIR": str(sockets),
                              "PROFAGENT_ONDEMAND_CONTROL_SOCKET": str(tmp_path / "control" / "c.sock")})
    try:
        agent.wait_healthy(f"http://127.0.0.1:{port}", timeout=60)
        assert {p: stat.S_IMODE(p.stat().st_mode) for p in (etc_like, sockets)} == before == {etc_like: 0o755, sockets: 0o700}
        assert "exists with mode 0755, used as it is" in agent.output  # the agent looked, and said so
        assert any(sockets.iterdir())  # the Kineto socket was bound in the existing folder
    finally:
        agent.stop()
    fresh = tmp_path / "fresh"
    agent = AgentProcess(["attach", "--pid", str(os.getpid()), "--listen", f"127.0.0.1:{port}", "--no-stacks"], tmp_path,
                         env={"PROFAGENT_ONDEMAND_TRACE_DIR": str(fresh), "PROFAGENT_ONDEMAND_SOCKET_DIR": str(sockets),
                              "PROFAGENT_ONDEMAND_CONTROL_SOCKET": str(tmp_path / "control" / "c.sock")})
    try:
        agent.wait_healthy(f"http://127.0.0.1:{port}", timeout=60)
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o1777  # created by the agent: its mode
    finally:
        agent.stop()

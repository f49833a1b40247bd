"""Issue 41 item 9: a user who binds Kineto's abstract ``@dynolog`` first would answer every
job's poll, and so tell alice's job to write its trace into nobody's folder.

Each test runs in a network namespace of its own (abstract socket names are per network
namespace, so no other agent of the node, nor a parallel test, holds or sees the name).
In it, a holder binds ``@dynolog`` first, then a root ``profagent watch`` starts. Held by
``nobody``: the agent refuses to start, in one line naming the holder and the fix, exit 2.
Held by root (a real dynolog daemon, say): the agent starts, on-demand tracing off for
that reason, as before.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.nobody import NOBODY, as_nobody
from helpers.processes import kill_tree, stop_process, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not all(shutil.which(t) for t in ("setpriv", "unshare", "nsenter")),
                       reason="plays a root agent against nobody in a network namespace: needs root, setpriv, unshare, nsenter"),
]

HOLD = "import socket, time\ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n" \
       "s.bind(b'\\0dynolog\\0')\nprint('bound', flush=True)\ntime.sleep(120)\n"


@pytest.fixture
def netns() -> Iterator[list[str]]:
    """The prefix that runs a command in a fresh network namespace (held by a sleeper)."""
    keeper = subprocess.Popen(["unshare", "--net", "sleep", "300"], start_new_session=True)
    wait_for(lambda: os.readlink(f"/proc/{keeper.pid}/ns/net") != os.readlink("/proc/self/ns/net"),
             10, what="the network namespace")
    yield ["nsenter", f"--net=/proc/{keeper.pid}/ns/net"]
    kill_tree(keeper)


def _hold(prefix: list[str], user: str) -> subprocess.Popen:
    cmd = [*prefix, *(as_nobody("/usr/bin/python3", "-c", HOLD) if user == "nobody" else
                      [sys.executable, "-c", HOLD])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env={"PATH": "/usr/bin:/bin"})
    assert proc.stdout is not None and proc.stdout.readline() == "bound\n"
    return proc


def _agent(prefix: list[str], tmp: Path) -> subprocess.Popen:
    config = tmp / "agent.toml"
    config.write_text(textwrap.dedent(f"""\
        state_dir = '{tmp / "state"}'
        [gpu]
        backend = "off"
        [stacks]
        enabled = false
        [timeline]
        enabled = false
        [watch]
        cmdline_regex = ""
        env_markers = ["PAW_TOKEN=none-of-this-node"]
        gpu_processes = false
        [ondemand]
        control_socket = '{tmp / "c.sock"}'
        trace_dir = '{tmp / "ondemand"}'
        """))
    return subprocess.Popen([*prefix, sys.executable, "-m", "profagent", "watch", "--listen", "127.0.0.1:0",
                             "--config", str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_a_root_agent_refuses_to_start_beside_dynolog_held_by_nobody(netns: list[str], tmp_path: Path) -> None:
    squatter = _hold(netns, "nobody")
    try:
        assert os.stat(f"/proc/{squatter.pid}").st_uid == NOBODY
        agent = _agent(netns, tmp_path)
        out, _ = agent.communicate(timeout=60)
    finally:
        kill_tree(squatter)
    assert agent.returncode == 2, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out, out
    assert f"@dynolog is held by PID {squatter.pid} of uid {NOBODY}, not by root" in errors[0]
    assert "ondemand.socket_dir" in errors[0] and "stop that process" in errors[0]


def test_doctor_names_who_holds_dynolog_and_what_to_do(netns: list[str], tmp_path: Path) -> None:
    squatter = _hold(netns, "nobody")
    try:
        (tmp_path / "doctor.toml").write_text(f"[ondemand]\ncontrol_socket = '{tmp_path / 'c.sock'}'\n"
                                              f"trace_dir = '{tmp_path / 'ondemand'}'\n")
        done = subprocess.run([*netns, sys.executable, "-m", "profagent", "doctor", "--config",
                               str(tmp_path / "doctor.toml")], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "COLUMNS": "400"})
    finally:
        kill_tree(squatter)
    out = " ".join((done.stdout + done.stderr).split())
    assert "Traceback" not in out and not out.startswith("error:"), out
    assert f"held by PID {squatter.pid} of uid {NOBODY}, not by root" in out, out
    assert "ondemand.socket_dir" in out


def test_a_root_agent_starts_beside_dynolog_held_by_root_with_ondemand_off(netns: list[str], tmp_path: Path) -> None:
    """The healthy neighbour: a root daemon (dynolog) holding the name is no attack."""
    daemon = _hold(netns, "root")
    agent = _agent(netns, tmp_path)
    try:
        assert agent.stdout is not None
        lines = []
        for line in agent.stdout:
            lines.append(line)
            if "metrics: http" in line:
                break
        banner = "".join(lines)
        assert "source ondemand: off: the Kineto daemon endpoint @dynolog is held by another daemon" in banner, banner
        assert agent.poll() is None  # serving
    finally:
        stop_process(agent)
        kill_tree(daemon)

"""Issue 41 item 9: a user who binds Kineto's abstract ``@dynolog`` first would answer every
job's poll, and so tell alice's job to write its trace into nobody's folder.

Each test runs in a network namespace of its own (abstract socket names are per network
namespace, so no other agent of the node, nor a parallel test, holds or sees the name).
In it, a holder binds ``@dynolog`` first, then a root ``profagent watch`` starts. Held by
``nobody``: the agent starts with on-demand tracing off, says why in one line, in
/healthz?verbose=1 and /metrics, and takes the name once nobody lets go.
Held by root (a real dynolog daemon, say): the agent starts, on-demand tracing off for
that reason, as before.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.nobody import NOBODY, as_nobody
from helpers.processes import kill_tree, stop_process, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not all(shutil.which(t) for t in ("setpriv", "unshare", "nsenter", "ip")),
                       reason="plays a root agent against nobody in a network namespace: needs root, setpriv, unshare, nsenter, ip"),
]

HOLD = "import socket, time\ns = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n" \
       "s.bind(b'\\0dynolog\\0')\nprint('bound', flush=True)\ntime.sleep(120)\n"


@pytest.fixture
def netns() -> Iterator[list[str]]:
    """The prefix that runs a command in a fresh network namespace (held by a sleeper)."""
    keeper = subprocess.Popen(["unshare", "--net", "sleep", "300"], start_new_session=True)
    wait_for(lambda: os.readlink(f"/proc/{keeper.pid}/ns/net") != os.readlink("/proc/self/ns/net"),
             10, what="the network namespace")
    prefix = ["nsenter", f"--net=/proc/{keeper.pid}/ns/net"]
    subprocess.run([*prefix, "ip", "link", "set", "lo", "up"], check=True, timeout=10)  # the agent's HTTP there
    yield prefix
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


def _in_netns(prefix: list[str], code: str, *args: str) -> str:
    """Run ``code`` with this checkout's profagent importable, in the namespace; its stdout."""
    done = subprocess.run([*prefix, sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    return done.stdout


GET = "import sys, urllib.request\nprint(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode(), end='')"
HOLDERS = ("from profagent.system.unixsock import abstract_address, abstract_holders\n"
           "print(sorted(h.pid for h in abstract_holders(abstract_address('dynolog\\0')) or ()))")


def test_a_root_agent_runs_beside_dynolog_held_by_nobody_and_takes_it_once_free(netns: list[str], tmp_path: Path) -> None:
    """Issue 51 high 5 (the attack: nobody binds @dynolog before the agent starts; the agent
    exited with status 2, which the unit's RestartPreventExitStatus=2 never restarts).
    Bound: the agent serves, on-demand tracing off: its banner, one warning line, /healthz?verbose=1
    and /metrics (collector_up 0, profagent_collector_retrying{reason="endpoint_held"} 1) say
    who holds it; once nobody lets go, the agent binds it within two retries (5 s each) and
    on-demand is on again."""
    squatter = _hold(netns, "nobody")
    agent = _agent(netns, tmp_path)
    try:
        assert os.stat(f"/proc/{squatter.pid}").st_uid == NOBODY
        assert agent.stdout is not None
        lines = []
        for line in agent.stdout:
            lines.append(line)
            if "metrics: http" in line:
                break
        banner = "".join(lines)
        assert agent.poll() is None, banner  # serving
        held = f"@dynolog is held by PID {squatter.pid} of uid {NOBODY}, not by root"
        assert f"source ondemand: off: the Kineto endpoint {held}" in " ".join(banner.split()), banner
        url = lines[-1].split("metrics:", 1)[1].strip().removesuffix("/metrics")
        health = _in_netns(netns, GET, url + "/healthz?verbose=1")
        assert health.startswith("ok\n") and f"ondemand: off (retrying: endpoint_held): the Kineto endpoint {held}" in health
        metrics = _in_netns(netns, GET, url + "/metrics")
        assert 'profagent_collector_up{collector="ondemand"} 0.0' in metrics
        assert 'profagent_collector_retrying{collector="ondemand",reason="endpoint_held"} 1.0' in metrics
        kill_tree(squatter)
        freed = time.monotonic()
        wait_for(lambda: 'profagent_collector_up{collector="ondemand"} 1.0' in _in_netns(netns, GET, url + "/metrics"),
                 30, interval=0.5, what="the agent's on-demand source on")
        taken = time.monotonic() - freed
        assert _in_netns(netns, HOLDERS).strip() == f"[{agent.pid}]"
        assert "ondemand: on" in _in_netns(netns, GET, url + "/healthz?verbose=1")
        assert "profagent_collector_retrying{" not in _in_netns(netns, GET, url + "/metrics")
        print(f"on-demand on {taken:.1f} s after nobody let go")
        assert taken < 15
    finally:
        kill_tree(squatter)
        stop_process(agent)
    out = banner + (agent.stdout.read() if agent.stdout else "")
    assert "Traceback" not in out, out
    assert sum("profagent's: on-demand tracing on" in line for line in out.splitlines()) == 1, out
    warned = [line for line in out.splitlines() if held in line and "WARNING" in line]
    assert len(warned) == 1, out


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

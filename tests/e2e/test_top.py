"""`profagent top` in a real terminal (tmux, 160x40) against a real agent and a 2-rank job."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import bcrypt
import pytest

from helpers.agent import free_port
from helpers.paths import WORKLOADS
from helpers.processes import wait_for

pytestmark = pytest.mark.slow

TOP = [sys.executable, "-m", "profagent", "top"]


def row(text: str, rank: str) -> str | None:
    """The table row of ``rank`` (the rank number is the first column; › marks the selection)."""
    for line in text.splitlines():
        if re.match(rf"^\s*›?{rank}\s+(running|STALLED)", line):
            return line
    return None


@pytest.fixture
def job(children, tmp_path: Path):
    hang = tmp_path / "hang"
    proc = subprocess.Popen([sys.executable, str(WORKLOADS / "two_ranks.py"), str(hang)], start_new_session=True)
    children.procs.append(proc)
    return proc, hang


def start_agent(run_agent, tmp_path: Path, pid: int, extra: list[str] | None = None):
    config = tmp_path / "agent.toml"
    # A short stall threshold; no GPU (a simulated one is always busy, which vetoes a stall);
    # no on-demand endpoint (it would collide with other agents on this machine).
    config.write_text("[stacks]\nstall_seconds = 3\n[ondemand]\nenabled = false\n")
    port = free_port()
    agent = run_agent(["attach", "--pid", str(pid), "--listen", f"127.0.0.1:{port}", "--gpu-backend", "off",
                       "--config", str(config), *(extra or [])])
    return agent, port


class Tmux:
    """A private tmux server (its own socket) running one command in a 160x40 window."""

    def __init__(self, tmp: Path, command: list[str]) -> None:
        if shutil.which("tmux") is None:
            pytest.fail("tmux is not installed: `apt-get install -y tmux` (the Makefile's set-up does it)")
        self.socket = str(tmp / "tmux.sock")
        env = f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}"
        self._run("new-session", "-d", "-x", "160", "-y", "40", "env", env, *command)

    def _run(self, *args: str) -> str:
        return subprocess.run(["tmux", "-S", self.socket, *args], capture_output=True, text=True, timeout=30).stdout

    def screen(self) -> str:
        return self._run("capture-pane", "-p", "-t", "0")

    def keys(self, *keys: str) -> None:
        self._run("send-keys", "-t", "0", *keys)

    def alive(self) -> bool:
        return subprocess.run(["tmux", "-S", self.socket, "has-session"], capture_output=True, timeout=30).returncode == 0

    def kill(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True, timeout=30)


def test_live_view_shows_both_ranks_and_marks_the_hung_one_stalled(job, run_agent, tmp_path) -> None:
    proc, hang = job
    agent, port = start_agent(run_agent, tmp_path, proc.pid)
    url = f"http://127.0.0.1:{port}"
    agent.wait_healthy(url)
    term = Tmux(tmp_path, [*TOP, "--url", url])
    try:
        screen = wait_for(lambda: (s := term.screen()) and row(s, "0") and row(s, "1") and "world 2" in s and s,
                          60, 0.5, "both ranks as rows")
        assert row(screen, "0").split()[1] == "running"
        assert "job top-" in screen and "node " in screen
        hang.touch()  # rank 1 now waits forever in wait_for_peer, like a rank stuck in a collective
        screen = wait_for(lambda: (s := term.screen()) and "STALLED" in (row(s, "1") or "") and s, 90, 0.5,
                          "rank 1 STALLED")
        assert "STALLED" not in row(screen, "0")
        assert "wait_for_peer" in row(screen, "1")
        term.keys("Down", "Enter")  # select rank 1, show its stack
        screen = wait_for(lambda: (s := term.screen()) and "current stack" in s and "wait_for_peer (two_ranks.py:" in s and s,
                          30, 0.5, "rank 1's current stack")
        assert "rank 1  pid" in screen and row(screen, "1").lstrip().startswith("›1")
        term.keys("q")
        wait_for(lambda: not term.alive(), 20, 0.2, "top to quit on q")
    finally:
        term.kill()

    # --once prints the same rows as plain text
    res = subprocess.run([*TOP, "--url", url, "--once"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "160"})
    assert res.returncode == 0, res.stderr
    assert "\x1b[" not in res.stdout  # plain text
    assert row(res.stdout, "0").split()[1] == "running"
    assert row(res.stdout, "1").split()[1] == "STALLED"
    assert "wait_for_peer" in row(res.stdout, "1")
    assert "world 2" in res.stdout


def test_once_at_80_columns_and_in_process_agent(job, tmp_path) -> None:
    proc, _ = job
    state = tmp_path / "state"
    res = subprocess.run([*TOP, "--pid", str(proc.pid), "--once", "--gpu-backend", "off"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "80", "PROFAGENT_STATE_DIR": str(state)})
    assert res.returncode == 0, res.stderr
    assert not (state / "incidents").exists()  # a viewer captures no incident bundles
    lines = res.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), res.stdout
    assert row(res.stdout, "0") and row(res.stdout, "1")
    cpu = [row(res.stdout, r).split()[3] for r in ("0", "1")]
    assert all(c.isdigit() and int(c) > 5 for c in cpu), res.stdout  # both ranks compute
    assert "train_step" in res.stdout


def test_in_process_agent_hosts_no_kineto_endpoint(job, children, tmp_path) -> None:
    """A viewer leaves the job's on-demand tracing to the running agent: an endpoint held
    by `top` would make that agent, restarted meanwhile, turn on-demand tracing off."""
    proc, _ = job
    sockets, control = tmp_path / "s", tmp_path / "c.sock"
    config = tmp_path / "top.toml"
    config.write_text(f"[ondemand]\nsocket_dir = '{sockets}'\ncontrol_socket = '{control}'\n")
    out = tmp_path / "top.out"
    with out.open("wb") as fh:
        top = subprocess.Popen([*TOP, "--pid", str(proc.pid), "--gpu-backend", "off", "--config", str(config),
                                "--interval", "1"], stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, "PROFAGENT_STATE_DIR": str(tmp_path / "state")})
    children.procs.append(top)
    # its agent is up: the table shows both ranks at work (its sources started with it)
    wait_for(lambda: "train_step" in out.read_text(errors="replace"), 60, what="a table from top")
    assert top.poll() is None, out.read_text()
    assert not sockets.exists() and not control.exists(), sorted(os.listdir(tmp_path))


def test_url_with_basic_auth_and_bad_input(job, run_agent, tmp_path) -> None:
    proc, _ = job
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  ops: {bcrypt.hashpw(b's3cret', bcrypt.gensalt(rounds=4)).decode()}\n")
    agent, port = start_agent(run_agent, tmp_path, proc.pid, ["--web-config", str(web)])
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: subprocess.run(["curl", "-sf", "-u", "ops:s3cret", url + "/healthz"], capture_output=True).returncode == 0,
             30, 0.3, "agent up")
    denied = subprocess.run([*TOP, "--url", url, "--once"], capture_output=True, text=True, timeout=60)
    assert denied.returncode == 2 and "--basic-auth" in denied.stderr and len(denied.stderr.strip().splitlines()) == 1
    secret = tmp_path / "auth"
    secret.write_text("ops:s3cret\n")
    ok = subprocess.run([*TOP, "--url", url, "--once", "--basic-auth-file", str(secret)], capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert row(ok.stdout, "0") and row(ok.stdout, "1")
    for args, needle in (
        ([], "give exactly one of --pid N"),
        (["--url", f"http://127.0.0.1:{free_port()}"], "cannot reach the agent"),
        (["--url", "ftp://x"], "bad --url"),
    ):
        res = subprocess.run([*TOP, *args, "--once"], capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr, res.stderr

"""Items 11 and 14 of issue 25: what the jobs name is data, never terminal or log control.

nobody runs a job whose ``RANK`` holds an OSC sequence (it renamed root's tmux pane),
whose ``SLURM_JOB_ID`` holds a newline followed by a fake log line, and whose only
function, created with ``co_name = "\\x1b[2J…"``, stalls under py-spy's eyes. A root agent
finds the hang and captures an incident; root then reads them with ``top --once``,
``diagnose``, ``incidents list`` and ``incidents show``. No ESC or BEL byte may reach
root's terminal, the hostile names must be shown escaped (so the test sees they got
there), and the agent's log has no forged line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.agent import free_port, http_get
from helpers.nobody import nobody_python
from helpers.processes import kill_tree, wait_for

RANK = "0\x1b]2;X\x1b\\"
FORGED = "profagent ERROR: forged by the job"
JOB_ID = f"evil\n{FORGED}\x1b[2J"
FUNCTION = "\x1b[2J\x1b]0\x07PWNED\x9bspin"  # no ";": py-spy's folded format splits frames there
JOB = textwrap.dedent(f"""
    import time

    def spin():
        while True:
            time.sleep(0.05)

    # a function whose name is a terminal command, as py-spy will read it from memory
    spin.__code__ = spin.__code__.replace(co_name={FUNCTION!r}, co_qualname={FUNCTION!r})
    spin()
""")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                       reason="plays a root agent against nobody: needs root and setpriv"),
]


@pytest.fixture
def hostile_job() -> Iterator[subprocess.Popen]:
    folder = Path(tempfile.mkdtemp(prefix="paw-output-"))
    folder.chmod(0o755)
    env = {"RANK": RANK, "LOCAL_RANK": "0", "WORLD_SIZE": "1", "SLURM_JOB_ID": JOB_ID}
    try:
        proc = nobody_python(JOB, env, folder)
        yield proc
        kill_tree(proc)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def cli(*args: str) -> bytes:
    """Root's command, its stdout and stderr as the terminal would get them."""
    done = subprocess.run([sys.executable, "-m", "profagent", *args], capture_output=True, timeout=120,
                          env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "200"})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out.decode(errors="replace")
    return out


def test_hostile_names_reach_no_terminal_and_forge_no_log_line(tmp_path: Path, run_agent, hostile_job) -> None:
    config = tmp_path / "agent.toml"
    (tmp_path / "s").mkdir()
    config.write_text(
        f"state_dir = '{tmp_path / 'state'}'\n"
        "[stacks]\nstall_seconds = 3\nwindow = 2\nrate = 20\n"
        f"[ondemand]\nsocket_dir = '{tmp_path / 's'}'\ncontrol_socket = '{tmp_path / 'c.sock'}'\n"
        f"trace_dir = '{tmp_path / 'ondemand'}'\n"
        f"[incidents]\ndir = '{tmp_path / 'incidents'}'\n"
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent = run_agent(["attach", "--pid", str(hostile_job.pid), "--listen", f"127.0.0.1:{port}",
                       "--config", str(config), "--gpu-backend", "off"])
    agent.wait_healthy(url, timeout=60)

    def hang_found() -> bool:
        findings = json.loads(http_get(url + "/api/findings"))["findings"]
        return any(f["finding"] == "hang" and any(FUNCTION in frame for frames in f["evidence"]["stacks"].values()
                                                  for frame in frames) for f in findings)

    wait_for(hang_found, 90, what="the hang found, with the hostile function in its stacks")
    incidents = wait_for(lambda: [m for m in json.loads(http_get(url + "/api/incidents"))["incidents"]
                                  if m.get("status") == "complete"], 120, what="the hang's incident captured")

    outputs = {
        "top": cli("top", "--url", url, "--once"),
        "diagnose": cli("diagnose", "--url", url),
        "incidents list": cli("incidents", "list", "--url", url),
        "incidents show": cli("incidents", "show", incidents[0]["id"], "--url", url),
    }
    for name, out in outputs.items():
        text = out.decode("utf-8", "replace")
        assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text, (name, text)
        assert b"\\x1b" in out, (name, out)  # the hostile name did reach the output, escaped
    assert b"\\x1b[2J\\x1b]0\\x07PWNED\\x9bspin" in outputs["diagnose"]  # the function, in the stack evidence
    assert b"0\\x1b]2;X\\x1b\\" in outputs["top"]  # the rank

    log = agent.output  # the agent's log and its banner
    assert "\x1b" not in log and "\x07" not in log and "\x9b" not in log
    assert not [line for line in log.splitlines() if line.startswith(FORGED)], log
    assert "evil\\x0aprofagent ERROR: forged" in log  # the job id was logged, on its own line


def _tmux(server: str, *args: str) -> str:
    return subprocess.run(["tmux", "-L", server, *args], capture_output=True, text=True, timeout=30).stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux to stand for root's terminal")
def test_live_top_in_tmux_keeps_roots_pane_title(tmp_path: Path, run_agent, hostile_job) -> None:
    """The reported attack: in tmux, the rank's OSC sequence renamed root's pane."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = tmp_path / "agent.toml"
    config.write_text(f"state_dir = '{tmp_path / 'state'}'\n[ondemand]\nenabled = false\n"
                      f"[incidents]\nenabled = false\n")
    agent = run_agent(["attach", "--pid", str(hostile_job.pid), "--listen", f"127.0.0.1:{port}",
                       "--config", str(config), "--gpu-backend", "off"])
    agent.wait_healthy(url, timeout=60)
    server = f"paw-{os.getpid()}-{port}"
    _tmux(server, "new-session", "-d", "-s", "top", "-x", "200", "-y", "50",
          f"{sys.executable} -m profagent top --url {url} --interval 0.5")
    try:
        wait_for(lambda: "\\x1b]2;X" in _tmux(server, "capture-pane", "-p", "-t", "top"), 60,
                 what="the hostile rank drawn, escaped")
        _tmux(server, "send-keys", "-t", "top", "Enter")  # the stack pane: the function's name
        wait_for(lambda: "PWNED" in _tmux(server, "capture-pane", "-p", "-t", "top"), 60,
                 what="the hostile function drawn, escaped")
        title = _tmux(server, "display-message", "-p", "-t", "top", "#{pane_title}").strip()
        assert title not in ("X", "") and "PWNED" not in title, title
    finally:
        _tmux(server, "kill-server")

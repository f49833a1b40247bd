"""`profagent attach` as a user runs it: a real job, a real agent, a real Prometheus."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers.agent import free_port, http_get, parse_metrics
from helpers.processes import wait_for
from helpers.prometheus import promtool_check_metrics
from profagent.target import not_a_training_job

JOB = """
import subprocess, sys, time
# A grandchild (DataLoader-worker-like) that burns a little CPU too.
subprocess.Popen([sys.executable, "-c", "import time\\nwhile True:\\n  sum(range(20000)); time.sleep(0.01)"])
x = 0
while True:
    for i in range(200000):
        x += i
    time.sleep(0.02)
"""


def _samples(text: str, name: str, **labels: str) -> list[float]:
    return [v for lab, v in parse_metrics(text).get(name, []) if all(lab.get(k) == w for k, w in labels.items())]


@pytest.fixture
def job(children):
    return children.python(JOB, env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "SLURM_JOB_ID": "e2e-1"})


@pytest.mark.slow
def test_attach_exports_to_a_real_prometheus(job, run_agent, prometheus) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    agent = run_agent(["attach", "--pid", str(job.pid), "--listen", f"127.0.0.1:{port}", "--interval", "0.2"])
    agent.wait_healthy(base)

    def two_processes() -> str:
        text = http_get(base + "/metrics")
        return text if len(_samples(text, "profagent_target_info")) == 2 else ""

    first = wait_for(two_processes, what="both processes in target_info")
    info = {lab["pid"]: lab for lab, _ in parse_metrics(first)["profagent_target_info"]}
    assert info[str(job.pid)]["role"] == "main" and info[str(job.pid)]["rank"] == "0"
    worker = next(lab for pid, lab in info.items() if pid != str(job.pid))
    assert (worker["role"], worker["rank"], worker["job_id"]) == ("dataloader", "0", "e2e-1")

    cpu0 = _samples(first, "profagent_process_cpu_seconds_total", job_id="e2e-1", rank="0", role="main", mode="user")
    wait_for(
        lambda: _samples(http_get(base + "/metrics"), "profagent_process_cpu_seconds_total",
                         job_id="e2e-1", rank="0", role="main", mode="user")[0] > cpu0[0],
        what="CPU seconds to grow",
    )
    text = http_get(base + "/metrics")
    assert _samples(text, "profagent_process_resident_memory_bytes", rank="0", role="main")[0] > 1_000_000
    assert _samples(text, "profagent_process_resident_memory_bytes", rank="0", role="dataloader")[0] > 1_000_000
    assert _samples(text, "profagent_target_up", job_id="e2e-1") == [1.0]
    assert _samples(text, "profagent_collector_up", collector="host") == [1.0]
    assert "Started" not in agent.output  # no stray noise
    assert promtool_check_metrics(text) == ""

    prom = prometheus([f"127.0.0.1:{port}"])
    result = wait_for(
        lambda: prom.query('profagent_process_cpu_seconds_total{rank="0",role="main",mode="user"}'),
        timeout=30, what="Prometheus to scrape the agent",
    )
    assert result[0]["metric"]["job_id"] == "e2e-1"
    assert float(result[0]["value"][1]) > 0
    rate = wait_for(lambda: prom.query('rate(profagent_process_cpu_seconds_total{role="main",mode="user"}[5s]) > 0'),
                    timeout=30, what="a positive CPU rate")
    assert rate
    up = prom.query('up{job="profagent"}')
    assert up and up[0]["value"][1] == "1"


@pytest.mark.slow
def test_attach_exits_zero_when_the_target_dies(job, run_agent) -> None:
    port = free_port()
    agent = run_agent(["attach", "--pid", str(job.pid), "--listen", f"127.0.0.1:{port}",
                       "--interval", "0.2", "--exit-grace", "0.5"])
    agent.wait_healthy(f"http://127.0.0.1:{port}")
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    assert agent.proc.wait(timeout=15) == 0
    assert "Traceback" not in agent.output


def test_a_never_scraped_agent_with_the_defaults_exits_a_few_seconds_after_its_target(job, run_agent) -> None:
    """The README's promise, with every source on and the default exit grace (3 s): nobody
    scraped /metrics (/healthz is not a scrape), so nobody waits for the job's last state."""
    port = free_port()
    agent = run_agent(["attach", "--pid", str(job.pid), "--listen", f"127.0.0.1:{port}", "--gpu-backend", "simulated"])
    agent.wait_healthy(f"http://127.0.0.1:{port}", timeout=60)
    wait_for(lambda: "stacks: on" in agent.output or "source stacks: on" in agent.output, 30, what="the banner")
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    killed = time.monotonic()
    assert agent.proc.wait(timeout=60) == 0
    # 3 s of grace, then stopping (under 2 s); generous for a loaded machine, far from 30 s.
    assert time.monotonic() - killed < 15, agent.output
    assert "whole tree are gone: exiting" in agent.output and "Traceback" not in agent.output


@pytest.mark.slow
def test_sigterm_stops_promptly(job, run_agent) -> None:
    port = free_port()
    # A 60 s stack window: an agent that waited for a py-spy window instead of stopping it
    # would take a minute, so a bound generous enough for a loaded machine still catches it.
    agent = run_agent(["attach", "--pid", str(job.pid), "--listen", f"127.0.0.1:{port}"],
                      env={"PROFAGENT_STACKS_WINDOW": "60"})
    agent.wait_healthy(f"http://127.0.0.1:{port}")
    began = time.monotonic()
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=30) == 0
    assert time.monotonic() - began < 20.0
    assert job.poll() is None, "the target must keep running"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profagent", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def _one_line_error(res: subprocess.CompletedProcess, fragment: str) -> None:
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert fragment in lines[0]


def test_bad_pid_exits_2_with_one_line() -> None:
    _one_line_error(_run("attach", "--pid", "4194000"), "no process with PID 4194000")


def test_port_in_use_exits_2(job) -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        _one_line_error(_run("attach", "--pid", str(job.pid), "--listen", f"127.0.0.1:{port}"), "already in use")
    assert job.poll() is None


def test_bad_config_exits_2_and_suggests(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("listn = ':1'\n")
    _one_line_error(_run("attach", "--pid", str(os.getpid()), "--config", str(cfg)), "did you mean 'listen'")
    cfg.write_text("listen = \n")
    _one_line_error(_run("attach", "--pid", str(os.getpid()), "--config", str(cfg)), "malformed config file")


def test_unreadable_web_config_exits_2(tmp_path: Path) -> None:
    _one_line_error(
        _run("attach", "--pid", str(os.getpid()), "--web-config", str(tmp_path / "none.yml")),
        "web config",
    )


def test_env_var_config(job) -> None:
    res = _run("config", env={"PROFAGENT_INTERVAL": "0.5"})
    assert "interval = 0.5" in res.stdout
    _one_line_error(_run("config", env={"PROFAGENT_INTERVALL": "0.5"}), "did you mean")


def test_usage_errors_are_one_line() -> None:
    _one_line_error(_run("attach", "--pidd", "3"), "No such option: --pidd")
    _one_line_error(_run("attach"), "Missing option '--pid'")


def test_version_and_help() -> None:
    res = _run("--version")
    assert res.returncode == 0 and res.stdout.startswith("profagent ")
    res = _run("attach", "--help")
    assert res.returncode == 0 and "--pid" in res.stdout and "--listen" in res.stdout


def test_attach_to_a_process_that_is_no_training_job_warns_in_one_line(job, tmp_path: Path, run_agent) -> None:
    """`sleep` has no Python and no rank: accepted (a launcher may start its ranks later),
    with one warning line. A Python job, or a shell whose child is Python, gets none."""
    sleeper = subprocess.Popen(["sleep", "300"], start_new_session=True)
    shell = subprocess.Popen(["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(300)'; true"],
                             start_new_session=True)
    try:
        port = free_port()
        agent = run_agent(["attach", "--pid", str(sleeper.pid), "--listen", f"127.0.0.1:{port}", "--gpu-backend", "off"])
        agent.wait_healthy(f"http://127.0.0.1:{port}", timeout=60)
        wait_for(lambda: "warning:" in agent.output, 30, what="the warning")
        lines = [line for line in agent.output.splitlines() if line.startswith("warning:")]
        assert len(lines) == 1 and f"PID {sleeper.pid} (sleep) is not a Python process" in lines[0], agent.output
        assert "launcher (torchrun) or a rank" in lines[0]
        assert agent.proc.poll() is None  # accepted, still running
        wait_for(lambda: psutil.Process(shell.pid).children(), 10, what="the shell's Python child")
        assert not_a_training_job(psutil.Process(shell.pid)) == ""
        assert not_a_training_job(psutil.Process(job.pid)) == ""
        assert not_a_training_job(psutil.Process(sleeper.pid)).startswith(f"PID {sleeper.pid} (sleep)")
    finally:
        for proc in (sleeper, shell):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

"""`profagent watch` as the service runs it: real jobs come and go, one endpoint serves them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.agent import free_port, http_get, parse_metrics
from helpers.processes import wait_for
from helpers.prometheus import promtool_check_metrics
from helpers.watch import FAKE_TORCHRUN, job_env, job_series, samples, token, watch_config


def _start(run_agent, tmp_path: Path, tok: str, **watch):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    agent = run_agent(["watch", "--config", str(watch_config(tmp_path, tok, **watch)),
                       "--listen", f"127.0.0.1:{port}"])
    agent.wait_healthy(base)
    return agent, base


def _scrape(base: str) -> dict:
    return parse_metrics(http_get(base + "/metrics"))


@pytest.mark.slow
def test_fake_torchrun_is_discovered_labelled_and_dropped_after_grace(children, run_agent, tmp_path) -> None:
    tok = token()
    agent, base = _start(run_agent, tmp_path, tok, grace_seconds=2.0)
    # One job whose launcher has SLURM_JOB_ID, one torchrun-like job whose ranks alone
    # carry TORCHELASTIC_RUN_ID, and a process without the marker that must be ignored.
    slurm = children.python(FAKE_TORCHRUN, env=job_env(tok, SLURM_JOB_ID="8101"))
    elastic = children.python(FAKE_TORCHRUN, env=job_env(tok, RANK_ENV="TORCHELASTIC_RUN_ID=run-e2e"))
    stranger = children.python(FAKE_TORCHRUN, env={"SLURM_JOB_ID": "9999", "LIFETIME": "3600"})

    def both_jobs():
        m = _scrape(base)
        infos = samples(m, "profagent_target_info")
        return m if len(infos) == 6 and len(samples(m, "profagent_process_cpu_seconds_total", mode="user")) == 6 else None

    m = wait_for(both_jobs, timeout=30, what="both jobs with 3 processes each")
    up = {lab["job_id"]: v for lab, v in samples(m, "profagent_target_up")}
    assert up == {"8101": 1.0, "run-e2e": 1.0}
    infos = {int(lab["pid"]): lab for lab, _ in samples(m, "profagent_target_info")}
    assert infos[slurm.pid]["role"] == "launcher" and infos[slurm.pid]["job_id"] == "8101"
    assert infos[elastic.pid]["role"] == "launcher" and infos[elastic.pid]["job_id"] == "run-e2e"
    ranks = sorted((lab["job_id"], lab["rank"], lab["local_rank"], lab["world_size"])
                   for lab in infos.values() if lab["role"] == "main")
    assert ranks == [("8101", "0", "0", "2"), ("8101", "1", "1", "2"),
                     ("run-e2e", "0", "0", "2"), ("run-e2e", "1", "1", "2")]
    assert stranger.pid not in infos
    assert samples(m, "profagent_process_resident_memory_bytes", job_id="8101", rank="0", role="main")[0][1] > 1e6
    assert promtool_check_metrics(http_get(base + "/metrics")) == ""

    os.killpg(slurm.pid, signal.SIGKILL)
    slurm.wait()

    def ended():
        m = _scrape(base)
        up = {lab["job_id"]: v for lab, v in samples(m, "profagent_target_up")}
        return m if up.get("8101") == 0.0 else None

    m = wait_for(ended, what="job 8101 marked down")
    assert not samples(m, "profagent_target_info", job_id="8101")
    # Counters stay through the grace period, so rate() sees the final value.
    assert samples(m, "profagent_process_cpu_seconds_total", job_id="8101", mode="user")

    m = wait_for(lambda: (s := _scrape(base)) and not [x for x in job_series(s) if x[1]["job_id"] == "8101"] and s,
                 timeout=20, what="job 8101's series to disappear after the grace period")
    assert {lab["job_id"] for _, lab in job_series(m)} == {"run-e2e"}
    assert "Traceback" not in agent.output
    assert "attached to job 8101" in agent.output and "job 8101 ended" in agent.output


@pytest.mark.slow
def test_sigterm_stops_watch_quickly_and_leaves_jobs_running(children, run_agent, tmp_path) -> None:
    tok = token()
    agent, base = _start(run_agent, tmp_path, tok)
    job = children.python(FAKE_TORCHRUN, env=job_env(tok, SLURM_JOB_ID="8102"))
    wait_for(lambda: samples(_scrape(base), "profagent_target_up", job_id="8102"), what="job found")
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=10) == 0
    assert job.poll() is None


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profagent", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--max-jobs", "0"], "watch.max_jobs"),
        (["--cmdline-regex", "train("], "fix the regular expression"),
        (["--listen", "nonsense"], "invalid listen address"),
    ],
)
def test_watch_bad_input_is_one_line_exit_2(args: list[str], fragment: str) -> None:
    res = _run("watch", *args)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], res.stderr

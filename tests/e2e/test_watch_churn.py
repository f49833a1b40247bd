"""Durability: 100+ short-lived python processes and 20 short jobs leave nothing behind.

After the churn and the grace period the agent must be back to its baseline: threads
(/proc/PID/task), file descriptors (/proc/PID/fd), py-spy children, and series in /metrics.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from helpers.agent import free_port, http_get, parse_metrics
from helpers.processes import fds, pyspy_processes, threads, wait_for
from helpers.watch import FAKE_TORCHRUN, job_env, job_series, samples, token, watch_config

# The driver carries no marker itself; everything it starts does.
#  - a long job whose rank 0 churns 50 DataLoader-like workers (0.25 s each);
#  - 50 single-process jobs (TORCHELASTIC_RUN_ID short-N) living 1 s, 5 at a time;
#  - 20 torchrun-like jobs (launcher + 2 ranks, SLURM_JOB_ID churn-N) living 2 s, 4 at a time.
# A short job ends after its lifetime once the agent has listed it (profagent_target_info),
# or after SEEN_DEADLINE: on a loaded machine a 1 s process can come and go between two
# scans, and a churn the agent never saw would make the leak checks vacuous (3 of 5
# loaded runs saw fewer than the 20 short jobs required when lifetimes were fixed).
DRIVER = """
import json, os, re, signal, subprocess, sys, time, urllib.request
TOK = sys.argv[1]
FAKE = sys.argv[2]
URL = sys.argv[3]
REPORT = sys.argv[4]
SEEN_DEADLINE = 30.0
base = dict(os.environ, PAW_TOKEN=TOK)
worker_loop = (
    "import subprocess, sys, time\\n"
    "for i in range(50):\\n"
    "    subprocess.run([sys.executable, '-c', 'import time; time.sleep(0.25)'])\\n"
    "while True:\\n"
    "    time.sleep(0.1)\\n"
)
long_launcher = subprocess.Popen(
    [sys.executable, "-c", "import subprocess, sys, time\\n"
     f"p = subprocess.Popen([sys.executable, '-c', {worker_loop!r}])\\n"
     "while True:\\n    time.sleep(0.1)\\n"],
    env=dict(base, SLURM_JOB_ID="churn-long", RANK="0", WORLD_SIZE="1"), start_new_session=True)

def listed():
    try:
        text = urllib.request.urlopen(URL + "/metrics", timeout=5).read().decode()
    except OSError:
        return set()
    return set(re.findall(r'^profagent_target_info[{].*?job_id="([^"]*)"', text, re.M))

def batch(envs, code, lifetime, job_var):
    now = time.monotonic()
    return [(subprocess.Popen([sys.executable, "-c", code], env=dict(base, LIFETIME="60", **e)),
             e[job_var], now + lifetime) for e in envs]

short_code = "import time; time.sleep(60)"
jobs_left = [dict(SLURM_JOB_ID=f"churn-{i}") for i in range(20)]
singles_left = [dict(TORCHELASTIC_RUN_ID=f"short-{i}", RANK="0") for i in range(50)]
running = []
unseen = 0
seen_jobs = set()  # every job id this driver saw the agent list
next_batch = 0.0
while jobs_left or singles_left or running:
    now = time.monotonic()
    if now >= next_batch and (jobs_left or singles_left):
        running += batch(singles_left[:5], short_code, 1.0, "TORCHELASTIC_RUN_ID")
        singles_left = singles_left[5:]
        running += batch(jobs_left[:2], FAKE, 2.0, "SLURM_JOB_ID")
        jobs_left = jobs_left[2:]
        next_batch = now + 0.6
    due = [r for r in running if now >= r[2]]
    seen = listed() if due else set()
    seen_jobs |= seen
    for r in due:
        proc, job, ends = r
        if job in seen or now >= ends + SEEN_DEADLINE:
            unseen += job not in seen
            proc.terminate()
            proc.wait()
            running.remove(r)
    time.sleep(0.1)
with open(REPORT, "w") as fh:
    json.dump({"unseen": unseen, "seen": sorted(seen_jobs)}, fh)
# Let the long job's 50 workers finish, then end it.
import psutil
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    kids = psutil.Process(long_launcher.pid).children(recursive=True)
    if len(kids) == 1:  # only its rank left: every worker is done
        break
    time.sleep(0.2)
time.sleep(0.5)
os.killpg(long_launcher.pid, signal.SIGKILL)
long_launcher.wait()
"""


STACK_FAMILIES = ("profagent_stack_", "profagent_rank_stack_", "profagent_rank_stalled")


class Observer(threading.Thread):
    """Scrapes every 0.2 s and records every job id and role seen."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.stop = threading.Event()
        self.jobs: set[str] = set()
        self.roles: set[tuple[str, str]] = set()
        self.failures = 0

    def run(self) -> None:
        while not self.stop.wait(0.2):
            try:
                m = parse_metrics(http_get(self.base + "/metrics", timeout=5))
            except Exception:
                self.failures += 1
                continue
            for lab, _ in samples(m, "profagent_target_info"):
                self.jobs.add(lab["job_id"])
                self.roles.add((lab["job_id"], lab["role"]))


def _series(base: str) -> set[tuple]:
    """Every series' identity, except the bounded error counters (new reasons may appear)."""
    m = parse_metrics(http_get(base + "/metrics"))
    return {(name, tuple(sorted(lab.items()))) for name, rows in m.items() for lab, _ in rows
            if not name.startswith(("profagent_collector_errors", "profagent_stack_sampler_errors"))}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_churn_leaves_no_threads_fds_pyspy_or_series_behind(children, run_agent, tmp_path) -> None:
    tok = token()
    cfg = watch_config(tmp_path, tok, grace_seconds=1.0, max_jobs=64)
    cfg.write_text(cfg.read_text().replace("[stacks]\nenabled = false", "[stacks]\nenabled = true\nwindow = 1.0"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    agent = run_agent(["watch", "--config", str(cfg), "--listen", f"127.0.0.1:{port}"])
    agent.wait_healthy(base)
    pid = agent.proc.pid

    # Warm-up: one job comes and goes, so lazily created threads and fds exist already.
    warm = children.python(FAKE_TORCHRUN, env=job_env(tok, SLURM_JOB_ID="warm"))
    wait_for(lambda: samples(parse_metrics(http_get(base + "/metrics")), "profagent_target_up", job_id="warm"),
             what="warm-up job")
    # py-spy children of the agent, zombies too: an unreaped py-spy counts as left behind.
    wait_for(lambda: pyspy_processes(of=pid, zombies=True), timeout=20, what="py-spy sampling the warm-up job")
    os.killpg(warm.pid, signal.SIGKILL)
    warm.wait()
    wait_for(lambda: not job_series(parse_metrics(http_get(base + "/metrics"))), what="warm-up series gone")
    wait_for(lambda: not pyspy_processes(of=pid, zombies=True), timeout=20, what="py-spy children gone after warm-up")
    base_threads, base_fds = threads(pid), fds(pid)
    base_series = _series(base)

    observer = Observer(base)
    observer.start()
    report = tmp_path / "unseen"
    driver = children.python(DRIVER.replace("sys.argv[1]", repr(tok)).replace("sys.argv[2]", repr(FAKE_TORCHRUN))
                             .replace("sys.argv[3]", repr(base)).replace("sys.argv[4]", repr(str(report))))
    peak_threads = peak_pyspy = 0
    deadline = time.monotonic() + 240  # ~40 s on an idle machine
    while driver.poll() is None and time.monotonic() < deadline:
        peak_threads = max(peak_threads, threads(pid))
        peak_pyspy = max(peak_pyspy, len(pyspy_processes(of=pid, zombies=True)))
        time.sleep(0.2)
    assert driver.poll() == 0, "the churn driver failed or took too long"
    wait_for(lambda: not job_series(parse_metrics(http_get(base + "/metrics"))), timeout=20,
             what="every job's series gone after the grace period")
    observer.stop.set()
    observer.join(5)

    # The churn was really observed (not a vacuous pass).
    # The driver ends each job once it saw the agent list it, so under load the observer
    # (a scrape every 0.2 s, when it gets the CPU) may miss the ~1 s it stays listed:
    # what either of them saw listed counts.
    driver_saw = json.loads(report.read_text())
    listed = observer.jobs | set(driver_saw["seen"])
    assert sum(j.startswith("churn-") and j != "churn-long" for j in listed) >= 15, (driver_saw, observer.jobs)
    assert sum(j.startswith("short-") for j in listed) >= 20, (driver_saw, observer.jobs)
    assert ("churn-long", "dataloader") in observer.roles
    assert peak_pyspy > 0, "py-spy never ran: the py-spy leak check would be vacuous"
    assert observer.failures == 0

    wait_for(lambda: not pyspy_processes(of=pid, zombies=True), timeout=20, what="no py-spy children left")
    wait_for(lambda: threads(pid) <= base_threads, timeout=20,
             what=f"threads back to {base_threads} (peak {peak_threads})")
    wait_for(lambda: fds(pid) <= base_fds, timeout=20, what=f"fds back to {base_fds}")
    after = _series(base)
    assert after == base_series, {"new": sorted(after - base_series)[:10], "gone": sorted(base_series - after)[:10]}
    assert agent.proc.poll() is None and "Traceback" not in agent.output



@pytest.mark.slow
@pytest.mark.timeout(170)
def test_stacks_series_of_ended_jobs_disappear(children, run_agent, tmp_path) -> None:
    tok = token()
    cfg = watch_config(tmp_path, tok, grace_seconds=1.0)
    cfg.write_text(cfg.read_text().replace("[stacks]\nenabled = false", "[stacks]\nenabled = true\nwindow = 1.0"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    agent = run_agent(["watch", "--config", str(cfg), "--listen", f"127.0.0.1:{port}"])
    agent.wait_healthy(base)
    before = _series(base)
    job = children.python(FAKE_TORCHRUN, env=job_env(tok, SLURM_JOB_ID="stk-1"))
    wait_for(lambda: any(s[0].startswith(STACK_FAMILIES) for s in _series(base) - before), timeout=30,
             what="stack series for the job")
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    wait_for(lambda: not job_series(parse_metrics(http_get(base + "/metrics"))), what="job series gone")
    wait_for(lambda: not {s for s in _series(base) - before if s[0].startswith(STACK_FAMILIES)}, timeout=10,
             what="stack series gone with the job")

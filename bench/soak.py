"""Soak: `profagent watch` for a long run against jobs that start and stop.

    python bench/soak.py [--duration 600] [--warmup 60] [--no-stacks] [--jobs 3]

A real `profagent watch` (discovering only this run's processes, by a marker) watches
torchrun-like jobs (a launcher and two ranks, each rank churning short DataLoader-like
workers) that start and end all the time, up to ``--jobs`` at once, while /metrics is
scraped every second. It prints the agent's RSS growth after warm-up (median of the
first 10 samples after warm-up vs. the last 10), its CPU use, threads, fds, py-spy
children, series and scrape latency. Goal: RSS growth <= 5% after warm-up.
Exit status 1 if the goal is missed.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import psutil

GOAL_RSS_GROWTH = 0.05

JOB = """
import os, random, subprocess, sys, time
life = float(os.environ["LIFETIME"])
rank_code = (
    "import subprocess, sys, time, random\\n"
    "end = time.monotonic() + 3600\\n"
    "while time.monotonic() < end:\\n"
    "    w = subprocess.Popen([sys.executable, '-c', 'import time; sum(range(200000)); time.sleep(0.5)'])\\n"
    "    x = 0\\n"
    "    for i in range(300000): x += i\\n"
    "    w.wait()\\n"
)
kids = []
for r in range(2):
    env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2")
    kids.append(subprocess.Popen([sys.executable, "-c", rank_code], env=env, start_new_session=False))
time.sleep(life)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = resp.read().decode()
    series = sum(1 for line in body.splitlines() if line and not line.startswith("#"))
    return time.perf_counter() - t0, series


def start_job(tok: str, n: int, lifetime: float) -> subprocess.Popen:
    env = dict(os.environ, PAW_TOKEN=tok, SLURM_JOB_ID=f"soak-{n}", LIFETIME=str(lifetime))
    return subprocess.Popen([sys.executable, "-c", JOB], env=env, start_new_session=True)


def end_job(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def write_config(folder: Path, tok: str, stacks: bool) -> Path:
    cfg = folder / "soak.toml"
    cfg.write_text(
        "interval = 1.0\n\n[gpu]\nbackend = \"off\"\n\n"
        f"[stacks]\nenabled = {'true' if stacks else 'false'}\n\n"
        f"[watch]\ncmdline_regex = \"\"\nenv_markers = [\"PAW_TOKEN={tok}\"]\ngrace_seconds = 5.0\n"
    )
    return cfg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of soak (default 600)")
    ap.add_argument("--warmup", type=float, default=None, help="seconds before RSS is baselined (default min(60, duration/4))")
    ap.add_argument("--jobs", type=int, default=3, help="jobs running at once (default 3)")
    ap.add_argument("--lifetime", type=float, nargs=2, default=(5.0, 20.0), metavar=("MIN", "MAX"), help="job lifetime range, seconds")
    ap.add_argument("--no-stacks", action="store_true", help="turn the py-spy source off")
    args = ap.parse_args()
    warmup = args.warmup if args.warmup is not None else min(60.0, args.duration / 4)

    tok = uuid.uuid4().hex[:12]
    tmp = Path(tempfile.mkdtemp(prefix="profagent-soak-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    log = (tmp / "agent.log").open("wb")
    agent = subprocess.Popen(
        [sys.executable, "-m", "profagent", "watch", "--config", str(write_config(tmp, tok, not args.no_stacks)),
         "--listen", f"127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    proc = psutil.Process(agent.pid)
    deadline = time.monotonic() + 30
    while True:
        try:
            scrape(url)
            break
        except OSError:
            if time.monotonic() > deadline or agent.poll() is not None:
                print(f"agent did not come up; log in {tmp / 'agent.log'}")
                return 2
            time.sleep(0.2)

    rng = random.Random(1)
    running: list[tuple[subprocess.Popen, float]] = []
    started = 0
    rss: list[tuple[float, int]] = []
    latencies: list[float] = []
    series: list[int] = []
    cpu_at_warmup: float | None = None
    kids_at_warmup = 0.0
    t_warm: float | None = None
    t0 = time.monotonic()
    next_tick = t0
    try:
        while (now := time.monotonic()) - t0 < args.duration:
            for job, end in list(running):
                if now >= end:
                    end_job(job)
                    running.remove((job, end))
            while len(running) < args.jobs:
                life = rng.uniform(*args.lifetime)
                running.append((start_job(tok, started, life + 5), now + life))
                started += 1
            latency, n = scrape(url)
            latencies.append(latency)
            series.append(n)
            rss.append((now - t0, proc.memory_info().rss))
            if cpu_at_warmup is None and now - t0 >= warmup:
                cpu = proc.cpu_times()
                cpu_at_warmup, t_warm = cpu.user + cpu.system, now
                kids_at_warmup = cpu.children_user + cpu.children_system
            next_tick += 1.0
            time.sleep(max(0.0, next_tick - time.monotonic()))
        cpu = proc.cpu_times()
        cpu_end, t_end = cpu.user + cpu.system, time.monotonic()
        kids_end = cpu.children_user + cpu.children_system
        threads, fds = proc.num_threads(), proc.num_fds()
    finally:
        for job, _ in running:
            end_job(job)
    # Let the last jobs age out, then look at what is left.
    time.sleep(8)
    _, idle_series = scrape(url)
    pyspy = sum(1 for c in proc.children(recursive=True) if c.name() == "py-spy")
    agent.send_signal(signal.SIGTERM)
    agent.wait(timeout=15)
    log.close()

    after = [r for t, r in rss if t >= warmup]
    if len(after) < 20:
        print("run too short to measure RSS growth after warm-up (need 20 s after it)")
        return 2
    base, last = statistics.median(after[:10]), statistics.median(after[-10:])
    growth = (last - base) / base
    span = t_end - (t_warm or t0)
    cpu_ratio = (cpu_end - (cpu_at_warmup or 0.0)) / span
    kids_ratio = (kids_end - kids_at_warmup) / span
    lat = sorted(latencies)
    print(f"soak: {args.duration:.0f}s (warm-up {warmup:.0f}s), {started} jobs started, up to {args.jobs} at once, "
          f"stacks {'off' if args.no_stacks else 'on'}")
    print(f"  RSS after warm-up {base / 2**20:.1f} MiB -> end {last / 2**20:.1f} MiB: growth {growth * 100:+.2f}% "
          f"(goal <= {GOAL_RSS_GROWTH * 100:.0f}%), max {max(r for _, r in rss) / 2**20:.1f} MiB")
    print(f"  CPU after warm-up: agent {cpu_ratio * 100:.1f}% of one core, its py-spy children {kids_ratio * 100:.1f}%")
    print(f"  scrape latency p50 {lat[len(lat) // 2] * 1e3:.1f} ms, p99 {lat[int(len(lat) * 0.99)] * 1e3:.1f} ms; "
          f"series max {max(series)}, idle after the run {idle_series}")
    print(f"  at the end: {threads} threads, {fds} fds; py-spy children after the run: {pyspy}")
    print(f"  agent log: {tmp / 'agent.log'}")
    return 0 if growth <= GOAL_RSS_GROWTH else 1


if __name__ == "__main__":
    sys.exit(main())

"""What `profagent attach` costs a CPU training job: interleaved A/B runs.

    python bench/overhead.py [--pairs 5] [--steps 3000] [--no-blocking]

The job is a small torch MLP on the CPU (one intra-op thread), running a fixed number of
steps after a warm-up. Each round runs it without the agent (A), with `profagent attach`
at default settings (B: stacks non-blocking), and, unless --no-blocking, with py-spy in
blocking mode (C: PROFAGENT_STACKS_NONBLOCKING=false). The order inside a round rotates,
so drift of the machine hits every condition alike. For B and C the agent is attached
and has sampled for a few seconds before the timed steps begin.

Printed: the slowdown of B and C against the A runs of the same rounds (mean, stdev and
median of the per-round ratios), both in wall time and in the job's own CPU time (the
latter is far less sensitive to other load on a shared machine, but does not see time
the job spends stopped, which only blocking mode causes); the agent's CPU as % of one
core during the timed steps (the agent plus its py-spy children); its peak RSS.
Goals (issue 4): slowdown <= 0.5% (hard limit 1%), agent <= 2% of a core, RSS <= 100 MB.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import psutil

JOB = textwrap.dedent("""
    import sys, time
    import torch
    from torch import nn
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    def step():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    for _ in range(200):
        step()
    print("ready", flush=True)
    sys.stdin.readline()
    began, cpu = time.perf_counter(), time.process_time()
    for _ in range(int(sys.argv[1])):
        step()
    print(time.perf_counter() - began, time.process_time() - cpu, flush=True)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_cpu(agent: psutil.Process) -> float:
    """CPU seconds of the agent and of its reaped children (py-spy windows), plus live ones."""
    t = agent.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in agent.children(recursive=True):
        try:
            c = child.cpu_times()
            total += c.user + c.system
        except psutil.Error:
            pass
    return total


def run(script: Path, steps: int, mode: str, settle: float) -> tuple[float, float, float | None, float | None]:
    """One timed run. Returns (wall seconds, job CPU seconds, agent CPU % of a core,
    agent peak RSS bytes)."""
    job = subprocess.Popen([sys.executable, str(script), str(steps)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    assert job.stdout.readline().strip() == "ready"
    agent = None
    env = dict(os.environ)
    if mode == "blocking":
        env["PROFAGENT_STACKS_NONBLOCKING"] = "false"
    if mode != "none":
        port = free_port()
        agent = subprocess.Popen([sys.executable, "-m", "profagent", "attach", "--pid", str(job.pid),
                                  "--listen", f"127.0.0.1:{port}", "--log-level", "warning"],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("agent did not come up") from None
                time.sleep(0.1)
        time.sleep(settle)  # let the sources reach their steady state
    proc = psutil.Process(agent.pid) if agent else None
    cpu0 = agent_cpu(proc) if proc else 0.0
    wall0 = time.monotonic()
    job.stdin.write("go\n")
    job.stdin.flush()
    peak = 0
    line = ""
    while not line:
        line = job.stdout.readline().strip()
        if proc:
            peak = max(peak, proc.memory_info().rss)
    seconds, job_cpu = (float(v) for v in line.split())
    cpu_pct = None
    if proc:
        cpu_pct = 100.0 * (agent_cpu(proc) - cpu0) / (time.monotonic() - wall0)
        agent.terminate()
        agent.wait(10)
    job.wait(10)
    return seconds, job_cpu, cpu_pct, (peak or None)


def sd(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--settle", type=float, default=4.0, help="seconds the agent runs before the timed steps")
    ap.add_argument("--no-blocking", action="store_true", help="skip the blocking-mode runs")
    args = ap.parse_args()

    script = Path(f"/tmp/profagent-bench-job-{os.getpid()}.py")
    script.write_text(JOB)
    modes = ["none", "nonblocking"] + ([] if args.no_blocking else ["blocking"])
    times: dict[str, list[float]] = {m: [] for m in modes}
    job_cpu: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    rss: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for i in range(args.pairs):
            order = modes[i % len(modes):] + modes[: i % len(modes)]
            for mode in order:
                seconds, used, pct, peak = run(script, args.steps, mode, args.settle)
                times[mode].append(seconds)
                job_cpu[mode].append(used)
                if pct is not None:
                    cpu[mode].append(pct)
                    rss[mode].append(peak)
                print(f"round {i + 1} {mode:12s} {seconds:7.3f} s wall {used:7.3f} s job CPU" + (f"  agent {pct:4.2f}% cpu" if pct is not None else ""), flush=True)
    finally:
        script.unlink(missing_ok=True)

    print(f"\nbaseline: {statistics.mean(times['none']):.3f} s wall, {statistics.mean(job_cpu['none']):.3f} s job CPU "
          f"for {args.steps} steps (stdev {sd(times['none']):.3f} / {sd(job_cpu['none']):.3f})")
    for mode in modes[1:]:
        for what, series in (("wall", times), ("job CPU", job_cpu)):
            slow = [100.0 * (b / a - 1.0) for a, b in zip(series["none"], series[mode], strict=True)]
            print(f"{mode:12s} {what:8s} slowdown {statistics.mean(slow):+.2f}% ± {sd(slow):.2f} "
                  f"(median {statistics.median(slow):+.2f}%; rounds {', '.join(f'{s:+.1f}' for s in slow)})")
        print(f"{mode:12s} agent {statistics.mean(cpu[mode]):.2f}% of a core (max {max(cpu[mode]):.2f}); "
              f"RSS peak {max(rss[mode]) / 2**20:.0f} MiB")

if __name__ == "__main__":
    main()

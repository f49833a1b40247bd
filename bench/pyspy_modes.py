"""py-spy as a continuous sampler: `record` windows against `dump` polling.

    python bench/pyspy_modes.py [--seconds 40] [--rate 20] [--windows 1,2,5,10]

One torch CPU training loop (small MLP, one thread) runs throughout and reports its step
count. Each mode runs for --seconds, in turn, with an idle phase before and after:

- record-Ws:      back-to-back `py-spy record --format raw --duration W --rate R --nonblocking`
                   (what the stacks source does), for each W of --windows;
- record-Ws-blocking: the longest window without --nonblocking;
- dump-poll-R:    `py-spy dump --json --nonblocking` as fast as R per second allows;
- dump-poll-0.5:  one dump every 2 s (the source's thread-state dumps).

Printed per mode: py-spy CPU in % of one core, samples per second actually obtained,
CPU per sample, and the job's steps/s against the idle phases.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from profagent.sources.stacks.pyspy import dump_args, find_pyspy, record_args

JOB = textwrap.dedent("""
    import sys, time
    import torch
    from torch import nn
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    steps, last = 0, time.monotonic()
    while True:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        steps += 1
        if time.monotonic() - last > 0.2:
            last = time.monotonic()
            with open(sys.argv[1] + ".tmp", "w") as fh:
                fh.write(str(steps))
            import os; os.replace(sys.argv[1] + ".tmp", sys.argv[1])
""")


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def steps(path: Path) -> int:
    while True:
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.01)


def record_mode(binary: str, pid: int, seconds: float, rate: int, nonblocking: bool, tmp: Path, window: int) -> int:
    samples, end = 0, time.monotonic() + seconds
    out = tmp / "w.txt"
    while time.monotonic() < end:
        subprocess.run(record_args(binary, pid, window, rate, "raw", out, nonblocking),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        for line in out.read_text().splitlines():
            samples += int(line.rsplit(" ", 1)[1])
    return samples


def dump_mode(binary: str, pid: int, seconds: float, rate: float) -> int:
    samples, end = 0, time.monotonic() + seconds
    period = 1.0 / rate
    while time.monotonic() < end:
        began = time.monotonic()
        res = subprocess.run(dump_args(binary, pid, True), capture_output=True, check=False)
        samples += res.returncode == 0
        time.sleep(max(0.0, period - (time.monotonic() - began)))
    return samples


def measure(name: str, fn, seconds: float, counter: Path, baseline: float) -> None:
    s0, c0, t0 = steps(counter), children_cpu(), time.monotonic()
    samples = fn()
    wall = time.monotonic() - t0
    cpu = children_cpu() - c0
    rate = (steps(counter) - s0) / wall
    print(f"{name:20s} py-spy {100 * cpu / wall:6.2f}% of a core  {samples / wall:6.1f} samples/s  "
          f"{1e3 * cpu / max(samples, 1):7.3f} ms CPU/sample  job {rate:6.1f} steps/s ({100 * (rate / baseline - 1):+.1f}%)",
          flush=True)


def idle_rate(counter: Path, seconds: float) -> float:
    s0, t0 = steps(counter), time.monotonic()
    time.sleep(seconds)
    return (steps(counter) - s0) / (time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--rate", type=int, default=20)
    ap.add_argument("--windows", default="1,2,5,10", help="record window lengths to compare, seconds")
    args = ap.parse_args()
    binary = find_pyspy()
    tmp = Path(tempfile.mkdtemp(prefix="profagent-bench-"))
    script, counter = tmp / "job.py", tmp / "steps"
    script.write_text(JOB)
    job = subprocess.Popen([sys.executable, str(script), str(counter)])
    try:
        steps(counter)
        time.sleep(2)
        windows = [int(w) for w in args.windows.split(",")]
        modes = [
            *((f"record-{w}s", lambda w=w: record_mode(binary, job.pid, args.seconds, args.rate, True, tmp, w))
              for w in windows),
            (f"record-{windows[-1]}s-blocking",
             lambda: record_mode(binary, job.pid, args.seconds, args.rate, False, tmp, windows[-1])),
            (f"dump-poll-{args.rate}", lambda: dump_mode(binary, job.pid, args.seconds, args.rate)),
            ("dump-poll-0.5", lambda: dump_mode(binary, job.pid, args.seconds, 0.5)),
        ]
        idle = [idle_rate(counter, args.seconds / 2)]
        for name, fn in modes:
            baseline = statistics.mean(idle)
            measure(name, fn, args.seconds, counter, baseline)
            idle.append(idle_rate(counter, args.seconds / 2))
        print(f"idle phases: {', '.join(f'{r:.1f}' for r in idle)} steps/s")
    finally:
        job.kill()
        job.wait()
        for f in tmp.iterdir():
            f.unlink()
        os.rmdir(tmp)


if __name__ == "__main__":
    main()

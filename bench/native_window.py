"""What a native window (py-spy record --native) costs against a plain one, side by side.

    .venv/bin/python bench/native_window.py [--rounds 3] [--window 5] [--rate 20]

Starts a torch job (one process, a matmul loop; libtorch loaded, as in a rank), then runs
plain and native windows on it alternately, and prints each kind's CPU seconds (py-spy's
user + system time, from wait4) per window, their ratio, and what one native window every
``stacks.native_every_seconds`` (300 s by default) costs as a share of one core, against
the agent's py-spy budget per rank (0.5% of a core).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from profagent.sources.stacks import pyspy

JOB = ("import torch, time\ntorch.set_num_threads(1)\nx = torch.randn(256, 256)\nprint('up', flush=True)\n"
       "while True:\n    y = x @ x\n    time.sleep(0.001)\n")


def window_cpu(binary: str, pid: int, seconds: int, rate: int, native: bool, out: Path) -> float:
    args = pyspy.record_args(binary, pid, seconds, rate, "raw", out, nonblocking=True, native=native)
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"py-spy failed ({'native' if native else 'plain'} window): exit {proc.returncode}")
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--rate", type=int, default=20)
    parser.add_argument("--every", type=float, default=300.0, help="stacks.native_every_seconds")
    args = parser.parse_args()
    binary = pyspy.find_pyspy()
    job = subprocess.Popen([sys.executable, "-c", JOB], stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "up"
        time.sleep(1.0)
        cpu: dict[bool, list[float]] = {False: [], True: []}
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.rounds):
                for native in (False, True):
                    cpu[native].append(window_cpu(binary, job.pid, args.window, args.rate, native,
                                                  Path(tmp) / f"{i}-{native}.txt"))
        plain, native = statistics.median(cpu[False]), statistics.median(cpu[True])
        print(f"plain window  ({args.window} s at {args.rate}/s): {plain:.3f} s CPU (median of {args.rounds})")
        print(f"native window ({args.window} s at {args.rate}/s): {native:.3f} s CPU (median of {args.rounds})")
        print(f"native / plain: {native / plain:.1f}x" if plain > 0 else "native / plain: plain too small to time")
        extra = (native - plain) / args.every
        print(f"one native window every {args.every:.0f} s: +{extra:.2%} of one core per rank "
              f"(budget for py-spy: 0.5%; plain windows alone: {plain / args.window:.2%})")
    finally:
        job.kill()
        job.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

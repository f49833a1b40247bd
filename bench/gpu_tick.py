"""Cost of one gpu-source tick on the simulated backend (8 GPUs by default).

    python bench/gpu_tick.py [--gpus 8] [--profile h100] [--ticks 500]

Every tick reads every field of every device through the NVML entry point (as in
production: NotSupported fields are remembered and skipped), lists the processes, reads
per-process utilisation and drains the XID event set, for a tree of one rank per GPU.
The figure is the simulated NVML plus profagent's own work; a real driver adds its call
latency (typically a few µs to tens of µs per call).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from profagent.contracts import ROLE_MAIN, ProcessInfo, ProcessTree
from profagent.sources.gpu.nvml import Nvml
from profagent.sources.gpu.profiles import PROFILES
from profagent.sources.gpu.simulated import SimulatedNvml
from profagent.sources.gpu.source import GpuSource


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--profile", default="h100", choices=sorted(PROFILES))
    ap.add_argument("--ticks", type=int, default=500)
    args = ap.parse_args()

    sim = SimulatedNvml(PROFILES[args.profile], args.gpus)
    source = GpuSource(Nvml(sim, simulated=True))
    source.start()
    # One rank per GPU; the PIDs only need to be consistent between tree and NVML.
    base = os.getpid()
    procs = tuple(
        ProcessInfo(base + r, base, 0.0, ROLE_MAIN, str(r), str(r), str(args.gpus), "train.py")
        for r in range(args.gpus)
    )
    tree = ProcessTree("bench", base, procs, alive=True)
    for _ in range(20):  # warm-up: NotSupported fields learned, caches filled
        source.collect(tree)
    times = []
    for _ in range(args.ticks):
        t0 = time.perf_counter()
        source.collect(tree)
        times.append(time.perf_counter() - t0)
    calls = sum(sim.calls.values())
    source.stop()
    times.sort()
    us = [t * 1e6 for t in times]
    print(f"gpu tick, {args.gpus} x {PROFILES[args.profile].name} (simulated), {args.ticks} ticks:")
    print(f"  median {statistics.median(us):.0f} µs, p99 {us[int(0.99 * (len(us) - 1))]:.0f} µs per tick")
    print(f"  {calls / (args.ticks + 20):.0f} NVML calls per tick")


if __name__ == "__main__":
    main()

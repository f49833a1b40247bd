"""Kernel launch delay: from the CPU runtime call's start to the kernel's start on the GPU.

Matched through the ``correlation`` arg that Kineto puts on both events. Delays are
clamped at 0 (clock skew between CPU and GPU timestamps can make a few negative).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from profagent.analysis.trace.kinds import Classified
from profagent.analysis.trace.model import KERNEL


@dataclass(frozen=True)
class LaunchDelay:
    count: int
    mean: float  # µs
    p50: float
    p99: float
    max: float


def launch_delay(c: Classified) -> LaunchDelay | None:
    """None when no kernel could be matched to its launch (CPU-only trace, no correlation)."""
    kernel = (c.trace.kind[c.gpu] == KERNEL) & ~np.isnan(c.gpu_launch)
    if not kernel.any():
        return None
    delays = np.sort(np.maximum(0.0, c.trace.ts[c.gpu][kernel] - c.gpu_launch[kernel]))
    n = len(delays)
    return LaunchDelay(
        count=n,
        mean=float(delays.mean()),
        p50=float(delays[(n - 1) // 2]),
        p99=float(delays[min(n - 1, int(0.99 * (n - 1) + 0.5))]),
        max=float(delays[-1]),
    )

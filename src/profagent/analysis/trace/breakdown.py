"""Step-time breakdown: every instant of a step gets exactly one category, by priority.

Priority (as tb-profiler did): kernel > memcpy > memset > communication > runtime >
dataloader > cpu_exec > other, so the categories add up to the step time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from profagent.analysis.trace.kinds import Frame

# Priority (as tb-profiler did): kernel > memcpy > memset > communication > runtime >
# dataloader > cpu_exec > other. An instant where a compute kernel runs is ``kernel`` even
# if the CPU is busy too; an instant where nothing below is active is ``other``.
#
# - kernel: GPU kernels except communication ones;
# - memcpy / memset: ``gpu_memcpy`` / ``gpu_memset``;
# - communication: NCCL/RCCL kernels, and CPU ranges named ``nccl:``, ``gloo:``, ``c10d::``...;
# - runtime: ``cuda_runtime``, ``cuda_driver``, ``cuda_sync`` (CUDA or HIP API calls);
# - dataloader: ``enumerate(DataLoader)#...__next__`` ranges;
# - cpu_exec: ATen ops (``cpu_op``);
# - other: the rest of the step (Python, waiting...).
CATEGORIES = ("kernel", "memcpy", "memset", "communication", "runtime", "dataloader", "cpu_exec", "other")
_UNIONS = {
    "kernel": ("kernel",), "memcpy": ("memcpy",), "memset": ("memset",),
    "communication": ("comm", "comm_cpu"), "runtime": ("runtime",),
    "dataloader": ("dataloader",), "cpu_exec": ("cpu_exec",),
}


@dataclass(frozen=True)
class Breakdown:
    per_step: tuple[dict[str, float], ...]  # category -> µs, one dict per step
    totals: dict[str, float]  # category -> µs over all steps
    ratios: dict[str, float]  # category -> share of total step time (sums to 1)


def step_breakdown(frame: Frame) -> Breakdown:
    """Time per category in each step, and over all steps."""
    free = frame.window.copy()
    columns: dict[str, np.ndarray] = {}
    for name in CATEGORIES[:-1]:
        mask = np.zeros_like(free)
        for key in _UNIONS[name]:
            mask |= frame.mask(key)
        mask &= free
        columns[name] = frame.per_step(mask)
        free &= ~mask
    columns["other"] = frame.per_step(free)
    per_step = tuple({name: float(columns[name][i]) for name in CATEGORIES} for i in range(frame.steps))
    totals = {name: float(columns[name].sum()) for name in CATEGORIES}
    whole = sum(totals.values())
    ratios = {name: (value / whole if whole > 0 else 0.0) for name, value in totals.items()}
    return Breakdown(per_step, totals, ratios)

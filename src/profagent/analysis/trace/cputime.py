"""CPU time against GPU time over the step window.

CPU time = |union of ATen ops and runtime calls, all threads| inside the window;
GPU time = |union of all GPU ops, all devices| inside the window. A ratio well above 1
means the CPU side is the bottleneck and the GPU is starved.
"""

from __future__ import annotations

from profagent.analysis.trace.kinds import Frame


def cpu_gpu_time(frame: Frame) -> tuple[float, float]:
    """(CPU µs, GPU µs) inside the steps."""
    gpu = frame.mask("kernel") | frame.mask("comm") | frame.mask("memcpy") | frame.mask("memset")
    return frame.time(frame.mask("cpu_all")), frame.time(gpu)

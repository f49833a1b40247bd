"""GPU time per device, from interval unions over GPU ops inside the step window.

Busy, idle (split into host wait and kernel wait), utilisation, compute, overlap and memcpy
share per device, over the union of the step spans; the definitions are above ``DeviceTime``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from profagent.analysis.trace.kinds import Classified, Frame


# For one device, with W = the union of the step spans (the analysed window):
#
# - busy = union of kernels, memcpy and memset; idle = W - busy;
# - utilization = |union of kernels| / |W| (tb-profiler's "GPU utilization": kernels only);
# - compute = union of non-communication kernels; non_compute = busy - compute
#   (communication and memory ops not hidden under compute); compute + non_compute + idle = W
#   (HolisticTraceAnalysis' temporal breakdown, over the step window);
# - idle is split per gap, using the op that ends the gap and its launching runtime call L:
#   host_wait = [gap start, min(L, gap end)) when L is after the gap start (the CPU had not
#   launched it yet), kernel_wait = the rest of the gap (the op was queued: launch latency,
#   stream/event dependencies); a gap no op ends (window tail) or without a launch is other;
# - overlap = |comm ∩ compute| / |comm| (share of communication hidden under compute);
# - memcpy share = |union of memcpy| / |busy|.
@dataclass(frozen=True)
class DeviceTime:
    device: int
    window: float  # µs
    busy: float
    kernel: float
    compute: float
    non_compute: float
    idle: float
    host_wait: float
    kernel_wait: float
    idle_other: float
    comm: float  # |union of communication kernels|
    overlap: float | None  # comm hidden under compute, share of comm; None without comm
    memcpy: float

    @property
    def idle_ratio(self) -> float:
        return self.idle / self.window if self.window > 0 else 0.0

    @property
    def utilization(self) -> float:
        return self.kernel / self.window if self.window > 0 else 0.0


def device_times(c: Classified, frame: Frame) -> tuple[DeviceTime, ...]:
    """One DeviceTime per device that has GPU ops in the window."""
    out = []
    for dev in c.devices:
        result = _one_device(c, frame, dev)
        if result is not None:
            out.append(result)
    return tuple(out)


def _one_device(c: Classified, frame: Frame, dev: int) -> DeviceTime | None:
    compute = frame.mask(f"kernel@{dev}")
    comm = frame.mask(f"comm@{dev}")
    memcpy = frame.mask(f"memcpy@{dev}")
    busy = compute | comm | memcpy | frame.mask(f"memset@{dev}")
    busy_t = frame.time(busy)
    if busy_t <= 0:
        return None
    window = frame.time(frame.window)
    compute_t = frame.time(compute)
    comm_t = frame.time(comm)
    host, queued, other = _split_idle(c, frame, dev, frame.window & ~busy)
    return DeviceTime(
        device=dev,
        window=window,
        busy=busy_t,
        kernel=frame.time(compute | comm),
        compute=compute_t,
        non_compute=busy_t - compute_t,
        idle=window - busy_t,
        host_wait=host,
        kernel_wait=queued,
        idle_other=other,
        comm=comm_t,
        overlap=frame.time(comm & compute) / comm_t if comm_t > 0 else None,
        memcpy=frame.time(memcpy),
    )


def _split_idle(c: Classified, frame: Frame, dev: int, gap_mask: np.ndarray) -> tuple[float, float, float]:
    gs, ge = frame.timeline.runs(gap_mask)
    if len(gs) == 0:
        return 0.0, 0.0, 0.0
    on = c.trace.device[c.gpu] == dev
    starts = c.trace.ts[c.gpu][on]  # sorted: c.gpu is sorted by start
    launch = c.gpu_launch[on]
    i = np.searchsorted(starts, ge, side="left")
    ends_gap = i < len(starts)
    ends_gap[ends_gap] = starts[i[ends_gap]] == ge[ends_gap]
    L = np.full(len(ge), np.nan)
    L[ends_gap] = launch[i[ends_gap]]
    known = ~np.isnan(L)
    split = np.clip(L[known], gs[known], ge[known])
    host = float((split - gs[known]).sum())
    queued = float((ge[known] - split).sum())
    other = float((ge[~known] - gs[~known]).sum())
    return host, queued, other

"""A parsed profiler trace: metadata plus the kept events as numpy columns.

The reader (``sources/traces/reader.py``) builds it; the analyzers only read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Event kinds the analyzers use (Kineto category -> kind code). Everything else (flows,
# python_function, counters...) is dropped while decoding. The categories are Kineto's
# (libkineto ActivityType names) that HolisticTraceAnalysis also reads:
# - device work: ``kernel``, ``gpu_memcpy``, ``gpu_memset`` (CUDA, ROCm/HIP, XPU),
#   ``mtia_ccp_events`` (MTIA device work: kernels and memory ops in one category);
# - runtime (host side API calls, with ``correlation``): ``cuda_runtime``, ``cuda_driver``
#   (also HIP calls on ROCm), ``mtia_runtime``, ``xpu_runtime``, ``privateuse1_runtime``,
#   ``privateuse1_driver``;
# - ``cuda_sync``: synchronisation, written on the CPU thread that waits (CPU runtime) or on
#   a GPU stream row (stream/event waits: neither runtime nor device work);
# - ``cpu_op`` (ATen ops), ``user_annotation`` (record_function, ProfilerStep#N).
CATEGORY_CODES = {
    "kernel": 0, "mtia_ccp_events": 0, "gpu_memcpy": 1, "gpu_memset": 2,
    "cuda_runtime": 3, "cuda_driver": 3, "mtia_runtime": 3, "xpu_runtime": 3,
    "privateuse1_runtime": 3, "privateuse1_driver": 3,
    "cpu_op": 4, "Operator": 4,
    "user_annotation": 5,
    "cuda_sync": 6,
}
KERNEL, MEMCPY, MEMSET, RUNTIME, CPU_OP, ANNOTATION, SYNC = range(7)

# The accelerator a category belongs to when only one does (CUDA's names are shared
# by ROCm and XPU: those are told apart by their runtime call names, see kinds.py).
ACCELERATOR_OF_CATEGORY = {
    "mtia_ccp_events": "mtia", "mtia_runtime": "mtia", "xpu_runtime": "xpu",
    "privateuse1_runtime": "privateuse1", "privateuse1_driver": "privateuse1",
}


@dataclass
class Trace:
    """One parsed trace: metadata and the kept events as columns (times in microseconds).

    Event ``i`` is ``kind[i]`` (see ``CATEGORY_CODES``), named ``names[name[i]]``, running on
    ``threads[thread[i]]`` (pid, tid) from ``ts[i]`` to ``end[i]``; GPU and runtime events
    carry ``corr[i]`` (-1: none) and GPU events ``device[i]``.
    """

    path: str
    bytes_read: int = 0  # uncompressed JSON bytes
    rank: str | None = None  # from distributedInfo
    world_size: int | None = None
    backend: str | None = None  # distributedInfo.backend
    base_time_ns: int | None = None
    device_count: int | None = None  # from deviceProperties, None when absent
    ts: np.ndarray = field(default_factory=lambda: np.empty(0))
    end: np.ndarray = field(default_factory=lambda: np.empty(0))
    kind: np.ndarray = field(default_factory=lambda: np.empty(0, np.int8))
    name: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    thread: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    corr: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    device: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    names: list[str] = field(default_factory=list)
    threads: list[tuple[int | str, int | str]] = field(default_factory=list)
    memory: list[tuple[int | None, int | None, int]] = field(default_factory=list)  # type, id, allocated
    # µs: libkineto's "Record Window End". CPU events after it were recorded while torch's
    # profiler was being stopped, on another thread, as the job went on (see find_steps)
    window_end: float | None = None
    cpu_pids: set[int] = field(default_factory=set)  # pids labelled CPU
    gpu_devices: dict[int, int] = field(default_factory=dict)  # trace pid -> device index
    categories: set[str] = field(default_factory=set)  # the kept events' Kineto categories
    device_names: list[str] = field(default_factory=list)  # deviceProperties[].name
    # complete events of a kept category left out for their ``dur``: cause (missing,
    # negative, non_finite) -> count, and the first few of their names
    bad_durations: dict[str, int] = field(default_factory=dict)
    bad_duration_names: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ts)

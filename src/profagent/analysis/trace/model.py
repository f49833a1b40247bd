"""A parsed profiler trace: metadata plus the kept events as numpy columns.

The reader (``sources/traces/reader.py``) builds it; the analyzers only read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Event kinds the analyzers use (Kineto category -> kind code). Everything else (flows,
# python_function, counters...) is dropped while decoding.
KINDS = {
    "kernel": 0, "gpu_memcpy": 1, "gpu_memset": 2,
    "cuda_runtime": 3, "cuda_driver": 3, "cuda_sync": 3,
    "cpu_op": 4, "Operator": 4,
    "user_annotation": 5,
}
KERNEL, MEMCPY, MEMSET, RUNTIME, CPU_OP, ANNOTATION = range(6)



@dataclass
class Trace:
    """One parsed trace: metadata and the kept events as columns (times in microseconds).

    Event ``i`` is ``kind[i]`` (see ``KINDS``), named ``names[name[i]]``, running on
    ``threads[thread[i]]`` (pid, tid) from ``ts[i]`` to ``end[i]``; GPU and runtime events
    carry ``corr[i]`` (-1: none) and GPU events ``device[i]``.
    """

    path: str
    bytes_read: int = 0  # uncompressed JSON bytes
    rank: str | None = None  # from distributedInfo
    world_size: int | None = None
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
    cpu_pids: set[int] = field(default_factory=set)  # pids labelled CPU
    gpu_devices: dict[int, int] = field(default_factory=dict)  # trace pid -> device index

    def __len__(self) -> int:
        return len(self.ts)

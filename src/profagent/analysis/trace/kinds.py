"""What each Kineto event is: the closed vocabulary every analyzer shares.

Kineto categories used (see ``model.CATEGORY_CODES``): device work ``kernel``, ``gpu_memcpy``,
``gpu_memset`` (CUDA, ROCm/HIP, XPU) and ``mtia_ccp_events`` (MTIA), on the device's
pid/``device``; runtime calls ``cuda_runtime``/``cuda_driver`` (CUDA, and HIP on ROCm),
``mtia_runtime``, ``xpu_runtime``, ``privateuse1_runtime``/``_driver``, carrying
``correlation``; ``cuda_sync`` counts as runtime only on a CPU thread (on a GPU stream row
it is a stream/event wait, not a CPU call); ``cpu_op`` (ATen ops), ``user_annotation``
(``record_function`` ranges, including ``ProfilerStep#N``).

``classify_events`` computes, once per trace, the index sets and unions every analyzer reads;
``Frame`` puts them on one shared grid restricted to the steps (see intervals.Timeline).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from profagent.analysis.trace.intervals import Merged, Timeline, merge, unique
from profagent.analysis.trace.model import (
    ACCELERATOR_OF_CATEGORY,
    ANNOTATION,
    CPU_OP,
    KERNEL,
    MEMCPY,
    MEMSET,
    RUNTIME,
    SYNC,
    Trace,
)

STEP_PREFIX = "ProfilerStep#"
DATALOADER_PREFIX = "enumerate(DataLoader)"
COMM_CPU_PREFIXES = ("nccl:", "gloo:", "c10d::", "record_param_comms", "mpi:")
GPU_KINDS = {KERNEL: "kernel", MEMCPY: "memcpy", MEMSET: "memset"}
US = 1e-6  # trace times are microseconds


def is_comm_kernel(name: str) -> bool:
    low = name.lower()
    return "nccl" in low or "rccl" in low


def _name_flags(names: list[str], pred) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.array([bool(pred(n)) for n in names] or [False], dtype=bool)


@dataclass(frozen=True)
class Classified:
    """Index sets (into the trace's columns) and unions, computed once per trace."""

    trace: Trace
    gpu: np.ndarray  # GPU ops, sorted by start
    gpu_launch: np.ndarray  # start of each GPU op's runtime call (NaN: unmatched)
    gpu_launcher: np.ndarray  # event index of that runtime call (-1: unmatched)
    gpu_comm: np.ndarray  # bool: communication kernel
    runtime: np.ndarray
    cpu_ops: np.ndarray  # ATen ops, ProfilerStep excluded
    annotations: np.ndarray  # user_annotation, ProfilerStep excluded
    steps: np.ndarray  # ProfilerStep ranges (annotation or op)
    unions: dict[str, Merged] = field(default_factory=dict)
    memo: dict[str, object] = field(default_factory=dict)  # figures several analyzers share

    @property
    def devices(self) -> list[int]:
        return sorted({int(d) for d in unique(self.trace.device[self.gpu])})

    def span(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.trace.ts[idx], self.trace.end[idx]


def classify_events(trace: Trace) -> Classified:
    """Split the kept events by kind and build the unions. Pure: ``trace`` is not modified."""
    t = trace
    step_name = _name_flags(t.names, lambda n: n.startswith(STEP_PREFIX))
    loader_name = _name_flags(t.names, lambda n: n.startswith(DATALOADER_PREFIX))
    comm_cpu_name = _name_flags(t.names, lambda n: n.startswith(COMM_CPU_PREFIXES))
    comm_kernel_name = _name_flags(t.names, is_comm_kernel)

    kind = t.kind
    is_step = step_name[t.name] if len(t) else np.zeros(0, dtype=bool)
    gpu = np.flatnonzero(kind <= MEMSET)
    gpu = gpu[np.argsort(t.ts[gpu], kind="stable")]
    runtime = np.flatnonzero((kind == RUNTIME) | ((kind == SYNC) & ~_on_device_rows(t, gpu)))
    cpu_like = (kind == CPU_OP) | (kind == ANNOTATION)
    steps = np.flatnonzero(cpu_like & is_step)
    cpu_ops = np.flatnonzero((kind == CPU_OP) & ~is_step)
    annotations = np.flatnonzero((kind == ANNOTATION) & ~is_step)
    gpu_comm = (kind[gpu] == KERNEL) & comm_kernel_name[t.name[gpu]]

    # launch time of each GPU op, through the correlation id of its runtime call
    rc = t.corr[runtime]
    valid = rc >= 0
    rc, ridx = rc[valid], runtime[valid]
    order = np.argsort(rc, kind="stable")
    rc, ridx = rc[order], ridx[order]
    gc = t.corr[gpu]
    pos = np.minimum(np.searchsorted(rc, gc), max(len(rc) - 1, 0))
    launcher = np.full(len(gpu), -1, dtype=np.int64)
    if len(rc):
        hit = (gc >= 0) & (rc[pos] == gc)
        launcher[hit] = ridx[pos[hit]]
    launch = np.full(len(gpu), np.nan)
    launch[launcher >= 0] = t.ts[launcher[launcher >= 0]]

    c = Classified(t, gpu, launch, launcher, gpu_comm, runtime, cpu_ops, annotations, steps)
    u = c.unions
    gkind, gdev = kind[gpu], t.device[gpu]
    gs, ge = t.ts[gpu], t.end[gpu]
    for code, label in GPU_KINDS.items():
        sel = gkind == code
        if code == KERNEL:
            u["comm"] = merge(gs[sel & gpu_comm], ge[sel & gpu_comm])
            sel &= ~gpu_comm
        u[label] = merge(gs[sel], ge[sel])
    devices = c.devices
    for dev in devices:
        if len(devices) == 1:  # the same unions: share them (Frame masks each union once)
            for label in ("comm", *GPU_KINDS.values()):
                u[f"{label}@{dev}"] = u[label]
            continue
        on = gdev == dev
        for code, label in GPU_KINDS.items():
            sel = on & (gkind == code)
            if code == KERNEL:
                u[f"comm@{dev}"] = merge(gs[sel & gpu_comm], ge[sel & gpu_comm])
                sel &= ~gpu_comm
            u[f"{label}@{dev}"] = merge(gs[sel], ge[sel])
    u["runtime"] = merge(*c.span(runtime))
    ops_loader = loader_name[t.name[cpu_ops]]
    ops_comm = comm_cpu_name[t.name[cpu_ops]] & ~ops_loader
    ann_loader = loader_name[t.name[annotations]]
    ann_comm = comm_cpu_name[t.name[annotations]] & ~ann_loader
    loader = np.concatenate([cpu_ops[ops_loader], annotations[ann_loader]])
    comm_cpu = np.concatenate([cpu_ops[ops_comm], annotations[ann_comm]])
    u["dataloader"] = merge(*c.span(loader))
    u["comm_cpu"] = merge(*c.span(comm_cpu))
    u["cpu_exec"] = merge(*c.span(cpu_ops[~ops_loader & ~ops_comm]))
    u["cpu_all"] = merge(*c.span(np.concatenate([cpu_ops, runtime])))
    return c


def _on_device_rows(t: Trace, gpu: np.ndarray) -> np.ndarray:
    """Per event: whether it is on a device row (a thread of a device pid)."""
    device_pids = set(t.gpu_devices) | {t.threads[i][0] for i in unique(t.thread[gpu]).tolist()}
    per_thread = np.array([p in device_pids for p, _ in t.threads] or [False], dtype=bool)
    return per_thread[t.thread] if len(t) else np.zeros(0, dtype=bool)


def accelerator(c: Classified) -> str | None:
    """The accelerator kind that ran the device work: cuda, rocm, mtia, xpu, privateuse1;
    None without device work (CPU-only trace)."""
    t = c.trace
    for cat in sorted(t.categories):
        kind = ACCELERATOR_OF_CATEGORY.get(cat)
        if kind is not None:
            return kind
    if len(c.gpu) == 0:
        return None
    runtime_names = {t.names[i] for i in unique(t.name[c.runtime]).tolist()}
    if any(n.startswith(("hip", "roctx")) for n in runtime_names) or any(
            "AMD" in d or "Radeon" in d or "Instinct" in d for d in t.device_names):
        return "rocm"
    return "cuda"


class Frame:
    """The unions of a trace on one grid, with the window (the steps) and step indexes."""

    def __init__(self, c: Classified, windows: list[tuple[float, float]]) -> None:
        ws = np.array([w[0] for w in windows], dtype=np.float64)
        we = np.array([w[1] for w in windows], dtype=np.float64)
        self.window_union = merge(ws, we)
        self.timeline = Timeline([*c.unions.values(), self.window_union])
        left = self.timeline.left
        self.window = self.timeline.mask(self.window_union)
        # which step each segment belongs to (steps tile: sorted, non-overlapping)
        i = np.searchsorted(ws, left, side="right") - 1
        inside = i >= 0
        inside[inside] = left[inside] < we[i[inside]]
        self.step_of = np.where(inside, i, -1)
        self.steps = len(windows)
        self._c = c
        self._masks: dict[int, np.ndarray] = {}  # id of a union in c.unions -> its mask

    def mask(self, key: str) -> np.ndarray:
        """The union ``key`` as a segment mask (all False if the trace has none)."""
        union = self._c.unions.get(key)
        if union is None:
            return np.zeros(len(self.timeline.left), dtype=bool)
        m = self._masks.get(id(union))
        if m is None:
            m = self._masks[id(union)] = self.timeline.mask(union)
        return m

    def time(self, mask: np.ndarray) -> float:
        """µs of ``mask`` inside the window."""
        return self.timeline.time(mask & self.window)

    def per_step(self, mask: np.ndarray) -> np.ndarray:
        """µs of ``mask`` in each step."""
        sel = mask & (self.step_of >= 0)
        return np.bincount(self.step_of[sel], weights=self.timeline.length[sel], minlength=self.steps)

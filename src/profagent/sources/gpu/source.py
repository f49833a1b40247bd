"""GPU source (NVML): device metrics, MIG, XID events, and GPU use per rank and role.

All NVML access goes through ``profagent.sources.gpu.nvml.Nvml``, so the same code runs on a
real driver and on the simulated backend. Per tick, every selected device is read field
by field; a lost device is reported down and the others go on.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pynvml

from profagent.config import Config
from profagent.contracts import (
    GpuDevice,
    GpuSnapshot,
    ProcessGpuUsage,
    ProcessInfo,
    ProcessTree,
)
from profagent.errors import NotApplicable, SourceError, SourceUnavailable
from profagent.sources.gpu.device import (
    NOT_AVAILABLE_UINT,
    DeviceHandle,
    identify,
    list_processes,
    read_clock_event_reasons,
    read_mig,
    read_values,
)
from profagent.sources.gpu.nvml import (
    DeviceLost,
    Nvml,
    cuda_version_text,
    open_backend,
    parse_backend,
    parse_gpus,
    text,
)
from profagent.system.procfs import read_nspid

log = logging.getLogger(__name__)

_XID_DRAIN_MAX = 256



@dataclass
class _Group:
    processes: int = 0
    memory: int | None = None
    sm: float | None = None
    mem_util: float | None = None


# Per-process attribution: NVML lists the processes on each device (compute, graphics and
# MPS client contexts; under MIG through each MIG device handle, which needs no privilege)
# with host PIDs. Each process of the target tree is known under every PID it
# has in the nested PID namespaces (``NSpid`` in /proc/PID/status), so the match works when
# the agent sees the host's PID namespace (on the host, ``docker --pid=host``,
# ``hostPID: true``). Memory comes from the process lists; SM and memory utilisation from
# ``nvmlDeviceGetProcessUtilization``, asking each tick only for samples newer than the
# last one seen. A listed process without a new sample keeps its value for one tick (the
# driver samples every 1/6 s to 1 s), then reads 0: it is idle (a driver makes no sample
# for a process that did no work). Processes are aggregated by (job, rank, role, gpu[, mig]);
# PIDs never become labels.
class GpuSource:
    name = "gpu"

    def __init__(
        self,
        nvml: Nvml,
        interval: float = 1.0,
        gpus: frozenset[int] | None = None,
        proc_root: str | Path = "/proc",
        note: str = "",
    ) -> None:
        self.nvml = nvml
        self.interval = interval
        self.note = note  # shown next to "on" in the banner
        self._gpus = gpus
        self._proc_root = Path(proc_root)
        self._lock = threading.Lock()
        self._devices: list[DeviceHandle] = []
        self._xids: dict[int, Counter[int]] = {}
        self._event_set: Any = None
        self._system = ("", "", "")
        self._nspid: dict[tuple[int, float], tuple[int, ...]] = {}
        self._last_seen: dict[int, int] = {}  # device index -> newest process-util sample (µs)
        # device index -> pid -> (sm, memory, ticks since its last sample)
        self._last_util: dict[int, dict[int, tuple[float, float, int]]] = {}
        self._namespace_hinted = False
        # In the host's PID namespace an NVML PID we cannot see has simply exited; only an
        # agent in a nested namespace can miss live GPU processes.
        self._nested_pid_namespace = len(read_nspid(self._proc_root, os.getpid())) > 1
        # Field errors by reason, for profagent_collector_errors_total (wired by the engine).
        self.record_error: Callable[[str], None] | None = None
        self._gpu_pids: frozenset[int] = frozenset()
        self._last: GpuSnapshot | None = None
        self._job_id = ""  # the tree's, for processes without their own job_id

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        """Init NVML and find the devices. Raises SourceUnavailable (one line) if it can't."""
        self.nvml.open()
        try:
            self._start()
        except SourceUnavailable:
            self.nvml.close()
            raise
        except pynvml.NVMLError as exc:
            self.nvml.close()
            raise SourceUnavailable(f"NVML failed while listing GPUs ({exc}): GPU metrics off; check `nvidia-smi`") from None

    def _start(self) -> None:
        r = self.nvml.read
        driver = text(r("system", "driver_version", "nvmlSystemGetDriverVersion") or "")
        nvml_version = text(r("system", "nvml_version", "nvmlSystemGetNVMLVersion") or "")
        cuda = cuda_version_text(r("system", "cuda_version", "nvmlSystemGetCudaDriverVersion"))
        self._system = (driver, nvml_version, cuda)
        count = self.nvml.call("nvmlDeviceGetCount")
        if count == 0:
            raise NotApplicable("NVIDIA driver loaded but no GPU found: GPU metrics off; check `nvidia-smi`", "no_gpu")
        indices = [i for i in range(count) if self._gpus is None or i in self._gpus]
        if not indices:
            wanted = ",".join(str(i) for i in sorted(self._gpus or ()))
            raise SourceUnavailable(
                f"--gpus {wanted}: no such GPU (this node has {count}, 0-{count - 1}): GPU metrics off; fix --gpus"
            )
        missing = sorted(set(self._gpus or ()) - set(indices))
        if missing:
            log.warning("--gpus: no GPU %s on this node (it has %d); reporting the others", missing, count)
        self._devices = [DeviceHandle(i) for i in indices]
        for dev in self._devices:
            try:
                identify(self.nvml, dev)
            except (DeviceLost, pynvml.NVMLError) as exc:  # e.g. NoPermission under cgroups
                log.warning("GPU %d does not answer (%s): reported down", dev.index, exc)
                dev.handle = None
        self._setup_events()
        if not self.note:
            self.note = f"{len(self._devices)} GPU(s), driver {driver}" if driver else f"{len(self._devices)} GPU(s)"

    def _setup_events(self) -> None:
        try:
            self._event_set = self.nvml.call("nvmlEventSetCreate")
        except (pynvml.NVMLError, DeviceLost) as exc:
            log.info("XID events not available (%s)", exc)
            return
        for dev in self._devices:
            self._register_events(dev)

    def _register_events(self, dev: DeviceHandle) -> None:
        """Ask for this device's XID events (again after it was lost: a returning GPU
        is a new registration for the driver)."""
        if self._event_set is None or dev.handle is None:
            return
        try:
            self.nvml.read(dev.key, "xid_events", "nvmlDeviceRegisterEvents", dev.handle,
                           pynvml.nvmlEventTypeXidCriticalError, self._event_set)
        except DeviceLost:
            pass

    def stop(self) -> None:
        with self._lock:
            if self._event_set is not None and self.nvml.opened:
                try:
                    self.nvml.call("nvmlEventSetFree", self._event_set)
                except (pynvml.NVMLError, DeviceLost, SourceUnavailable):
                    pass  # shutting down anyway
            self._event_set = None
            self.nvml.close()

    # -- one tick -----------------------------------------------------------------------
    def collect(self, tree: ProcessTree) -> GpuSnapshot:
        with self._lock:
            if not self.nvml.opened:  # a tick racing stop(): repeat the last picture
                if self._last is None:
                    raise SourceError("NVML is shut down", reason="stopped")
                return self._last
            self._job_id = tree.job_id
            self.nvml.hint_processes(_rank_gpu_hints(tree))
            aliases = self._aliases(tree)
            self._drain_xids()
            groups: dict[tuple[str, str, str, int, str, str], _Group] = {}
            pids: set[int] = set()
            devices = tuple(self._read_device(dev, aliases, groups, pids) for dev in self._devices)
            self._gpu_pids = frozenset(pids)
            errors = self.nvml.take_errors()
        if self.record_error is not None:
            for reason, count in sorted(errors.items()):
                for _ in range(count):
                    self.record_error(reason)
        processes = tuple(
            ProcessGpuUsage(job, rank, role, gpu, uuid, mig, g.processes, g.memory,
                            None if g.sm is None else min(1.0, g.sm),
                            None if g.mem_util is None else min(1.0, g.mem_util))
            for (job, rank, role, gpu, uuid, mig), g in sorted(groups.items())
        )
        driver, nvml_version, cuda = self._system
        self._last = GpuSnapshot(tree.job_id, self.nvml.simulated, driver, nvml_version, cuda, devices, processes)
        return self._last

    def gpu_pids(self) -> frozenset[int]:
        """PIDs that held a GPU context at the last tick (NVML's, plus our own PID for each
        tree process matched through NSpid). No NVML call: for ``profagent watch``."""
        return self._gpu_pids

    def _read_device(self, dev: DeviceHandle, aliases: dict[int, ProcessInfo], groups: dict, pids: set[int]) -> GpuDevice:
        try:
            if dev.handle is None:
                try:
                    identify(self.nvml, dev)
                except pynvml.NVMLError as exc:
                    dev.handle = None
                    raise DeviceLost(str(exc)) from None
                if dev.lost:
                    log.warning("GPU %d answers again", dev.index)
                    dev.lost = False
                    self._register_events(dev)
                    self._drain_xids()
            else:
                # The device-level query: only this deciding "lost" or "unknown" marks
                # the GPU down; the same answer from one field is a field error.
                self.nvml.call("nvmlDeviceGetHandleByIndex", dev.index, device_level=True)
            values = read_values(self.nvml, dev)
            reasons = read_clock_event_reasons(self.nvml, dev)
            mig = read_mig(self.nvml, dev)
            mine: dict = {}
            others = self._attribute(dev, aliases, mine, pids)
        except DeviceLost as exc:
            if not dev.lost:
                log.warning("GPU %d is down (%s); the other GPUs go on", dev.index, exc)
            dev.lost, dev.handle = True, None  # identify again (and re-register events) when it answers
            self._last_util.pop(dev.index, None)
            self._last_seen.pop(dev.index, None)
            xids = MappingProxyType(dict(self._xids.get(dev.index, {})))
            return GpuDevice(dev.index, dev.uuid, dev.name, dev.pci_bus_id, dev.mig_mode, up=False, xid_errors=xids)
        xids = MappingProxyType(dict(self._xids.get(dev.index, {})))
        for key, g in mine.items():
            groups[key] = g
        return GpuDevice(
            dev.index, dev.uuid, dev.name, dev.pci_bus_id, dev.mig_mode, up=True,
            values=MappingProxyType(values), clock_event_reasons=MappingProxyType(reasons),
            xid_errors=xids, mig_devices=mig, other_processes=others,
        )

    def _attribute(self, dev: DeviceHandle, aliases: dict[int, ProcessInfo], groups: dict, pids: set[int]) -> int | None:
        """Add this device's target processes to ``groups``; return how many other
        processes use it (None if NVML lists no processes here)."""
        listed = list_processes(self.nvml, dev)
        if listed is None:
            return None
        util = self._process_util(dev, set(listed))

        others = 0
        for pid, (memory, gi) in listed.items():
            info = aliases.get(pid)
            pids.add(pid if info is None else info.pid)
            if info is None:
                others += 1
                self._hint_namespace(pid)
                continue
            mig = str(gi) if dev.mig_mode == "enabled" and gi != NOT_AVAILABLE_UINT else ""
            job = info.job_id or self._job_id
            g = groups.setdefault((job, info.rank, info.role, dev.index, dev.uuid, mig), _Group())
            g.processes += 1
            if memory is not None:
                g.memory = (g.memory or 0) + memory
            if util is not None:
                sm, mm = util.get(pid, (0.0, 0.0))  # listed without a sample: idle
                g.sm = (g.sm or 0.0) + sm
                g.mem_util = (g.mem_util or 0.0) + mm
        return others

    def _process_util(self, dev: DeviceHandle, pids: set[int]) -> dict[int, tuple[float, float]] | None:
        """pid -> (sm, memory) ratios from the samples newer than the last seen. A process
        without a new sample keeps its value for one tick, then is left out (the caller
        reads that as idle, 0). None when unsupported (absent, not 0)."""
        if not pids:
            return {}
        if dev.mig_mode == "enabled" and not self.nvml.supported(dev.key, "process_utilization"):
            return None
        last_seen = self._last_seen.get(dev.index, 0)
        samples = self.nvml.read(dev.key, "process_utilization", "nvmlDeviceGetProcessUtilization",
                                 dev.handle, last_seen, not_found=[])
        if samples is None and not self.nvml.supported(dev.key, "process_utilization"):
            return None
        fresh: dict[int, list[tuple[float, float]]] = {}
        newest = last_seen
        for s in samples or ():  # None: this tick failed, treated as "no new sample"
            if s.timeStamp <= last_seen:
                continue
            newest = max(newest, s.timeStamp)
            fresh.setdefault(s.pid, []).append((s.smUtil / 100.0, s.memUtil / 100.0))
        self._last_seen[dev.index] = newest
        held: dict[int, tuple[float, float, int]] = {}
        for pid, (sm, mm, age) in self._last_util.get(dev.index, {}).items():
            if pid in pids and pid not in fresh and age < 1:
                held[pid] = (sm, mm, age + 1)
        for pid, vals in fresh.items():
            held[pid] = (sum(a for a, _ in vals) / len(vals), sum(b for _, b in vals) / len(vals), 0)
        self._last_util[dev.index] = held
        return {pid: (sm, mm) for pid, (sm, mm, _) in held.items()}

    def _drain_xids(self) -> None:
        if self._event_set is None:
            return
        by_uuid = {d.uuid: d.index for d in self._devices if d.uuid}
        for _ in range(_XID_DRAIN_MAX):
            try:
                data = self.nvml.call("nvmlEventSetWait_v2", self._event_set, 0)
                if not data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                    continue
                uuid = text(self.nvml.call("nvmlDeviceGetUUID", data.device))
            except pynvml.NVMLError_Timeout:
                return
            except (pynvml.NVMLError, DeviceLost) as exc:
                log.debug("reading XID events: %s", exc)
                return
            index = by_uuid.get(uuid)
            if index is not None:
                self._xids.setdefault(index, Counter())[int(data.eventData)] += 1

    def _aliases(self, tree: ProcessTree) -> dict[int, ProcessInfo]:
        """Every PID (in any nested namespace) of every tree process -> the process."""
        out: dict[int, ProcessInfo] = {}
        seen: dict[tuple[int, float], tuple[int, ...]] = {}
        for p in tree.processes:
            key = (p.pid, p.create_time)
            ids = self._nspid.get(key) or read_nspid(self._proc_root, p.pid)
            seen[key] = ids
            for pid in ids:
                out.setdefault(pid, p)
        for p in tree.processes:
            out[p.pid] = p  # the PID in our own namespace wins
        self._nspid = seen
        return out

    def _hint_namespace(self, pid: int) -> None:
        if self._namespace_hinted or not self._nested_pid_namespace or (self._proc_root / str(pid)).exists():
            return
        self._namespace_hinted = True
        log.warning(
            "NVML lists GPU process %d, which this agent cannot see (another PID namespace): "
            "per-process GPU metrics need the host's PIDs; run the agent with --pid=host "
            "(Kubernetes: hostPID: true)", pid,
        )


def _rank_gpu_hints(tree: ProcessTree) -> list[tuple[int, int]]:
    """(pid, local rank) of every rank process: where the simulated backend puts them."""
    out = []
    for n, p in enumerate(tree.mains()):
        lr = p.local_rank if p.local_rank.isdigit() else p.rank
        out.append((p.pid, int(lr) if lr.isdigit() else n))
    return out


def build_gpu_source(config: Config) -> GpuSource | None:
    """The gpu source the configuration asks for; None when ``gpu.backend = off``.
    Raises UserError for a malformed backend or GPU list."""
    spec = parse_backend(config.gpu.backend)
    gpus = parse_gpus(config.gpu.gpus)
    if spec.kind == "off":
        return None
    note = f"SIMULATED: {spec.label.removeprefix('simulated ')}, not real hardware" if spec.kind == "simulated" else ""
    return GpuSource(open_backend(spec), interval=config.interval_of("gpu"), gpus=gpus, note=note)

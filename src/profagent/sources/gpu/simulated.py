"""A simulated NVML: the pynvml functions profagent uses, for machines without a GPU.

The production source runs on it unchanged; it is selected only by
``--gpu-backend simulated[:PROFILE[xN]]``, never automatically.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pynvml

from profagent.sources.gpu.profiles import MIB, MigSlice, Profile

DRIVER_VERSION = "550.90.07"
NVML_VERSION = "12.550.90.07"
CUDA_DRIVER_VERSION = 12040  # 12.4
NOT_AVAILABLE_UINT = 0xFFFFFFFF
_MIG_HANDLE_FUNCTIONS = frozenset(
    {
        "nvmlDeviceGetName",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetGpuInstanceId",
        "nvmlDeviceGetComputeInstanceId",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetGraphicsRunningProcesses",
        "nvmlDeviceGetMPSComputeRunningProcesses",
    }
)
# Process lists on a MIG-enabled GPU's parent handle need root (nvml.h); the agent
# usually is not, so the simulation answers as to a normal user.
_PARENT_NEEDS_ROOT_UNDER_MIG = frozenset(
    {
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetGraphicsRunningProcesses",
        "nvmlDeviceGetMPSComputeRunningProcesses",
    }
)
_PROCESS_INFO = getattr(pynvml, "c_nvmlProcessInfo_v3_t", None) or pynvml.c_nvmlProcessInfo_t


def nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # maps to the real subclass, e.g. NVMLError_NotSupported


@dataclass(eq=False)
class Handle:
    index: int
    mig: MigSlice | None = None


@dataclass
class EventSet:
    devices: set[int] = field(default_factory=set)
    queue: list[EventData] = field(default_factory=list)


@dataclass(frozen=True)
class EventData:
    """Same attribute names as pynvml's c_nvmlEventData_t."""

    device: Handle
    eventType: int
    eventData: int
    gpuInstanceId: int
    computeInstanceId: int


@dataclass
class _Device:
    index: int
    handle: Handle
    uuid: str
    lost: bool = False
    not_supported: set[str] = field(default_factory=set)
    energy_mj: float = 0.0
    nvlink_tx_kib: float = 0.0
    nvlink_rx_kib: float = 0.0
    last_t: float = 0.0


def _uuid(seed: str) -> str:
    h = hashlib.sha1(seed.encode()).hexdigest()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


# ``SimulatedNvml`` quacks like the ``pynvml`` module at its boundary: the same function
# names and arguments, the same ctypes structures as return values, and failures raised as
# the real ``pynvml.NVMLError`` subclasses with their real codes. The production source
# runs on it unchanged. It is selected only by ``--gpu-backend simulated[:PROFILE[xN]]``,
# never automatically.
#
# Behaviour:
#
# - static properties come from a profile (``profiles.py``);
# - utilisation is a healthy training job's on GPUs that have target processes (steady
#   around 88%, a few points of step-to-step jitter, never throttled) and stays 0 on the
#   others; power, temperature, clocks and PCIe/NVLink traffic follow utilisation. Anything
#   unhealthy (a dip, a power cap, an XID) is scripted on purpose: ``simulated:FILE.yaml``
#   (``scripted.py``) or the test hooks below;
# - energy, NVLink and ECC counters only go up;
# - per-process memory and utilisation are reported for the PIDs handed over with
#   ``simulatedSetTargetProcesses`` (the source passes the target's real rank PIDs, so
#   attribution works end to end): local rank L sits on GPU ``L mod N`` (or, under MIG, on
#   MIG slice ``L mod slices``).
#
# Test hooks (not NVML functions, all prefixed ``simulated``): ``simulatedSetNotSupported``,
# ``simulatedLoseGpu``, ``simulatedInjectXid``, ``simulatedFailInit``; ``calls`` counts every
# call per (function, device index).
class SimulatedNvml:
    """A fresh simulated node per instance (no module state)."""

    def __init__(
        self,
        profile: Profile,
        count: int = 1,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.profile = profile
        self.count = count
        self.calls: Counter[tuple[str, int]] = Counter()
        self._clock = clock
        self._wall = wall
        self._t0 = clock()
        self._refcount = 0
        self._init_error: int | None = None
        self._targets: dict[int, int] = {}  # pid -> local rank
        self._event_sets: list[EventSet] = []
        self._devices = [
            _Device(
                index=i,
                handle=Handle(i),
                uuid="GPU-" + _uuid(f"{profile.key}/{i}"),
                energy_mj=1.0e9 + 3.7e7 * i,
                last_t=self._t0,
            )
            for i in range(count)
        ]

    # -- test hooks ---------------------------------------------------------------
    def simulatedSetTargetProcesses(self, procs: Iterable[tuple[int, int]]) -> None:
        """(pid, local_rank) of the processes that use the GPUs."""
        self._targets = dict(procs)

    def simulatedSetNotSupported(self, index: int, function: str) -> None:
        self._devices[index].not_supported.add(function)

    def simulatedLoseGpu(self, index: int) -> None:
        """From now on every call on this device raises NVMLError_GpuIsLost."""
        self._devices[index].lost = True

    def simulatedInjectXid(self, index: int, xid: int) -> None:
        for es in self._event_sets:
            if index in es.devices:
                es.queue.append(EventData(self._devices[index].handle, pynvml.nvmlEventTypeXidCriticalError, xid, NOT_AVAILABLE_UINT, NOT_AVAILABLE_UINT))

    def simulatedFailInit(self, code: int | None) -> None:
        """Make nvmlInit fail with this NVML error code (None: succeed again)."""
        self._init_error = code

    # -- helpers ------------------------------------------------------------------
    def _ready(self) -> None:
        if self._refcount <= 0:
            raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)

    def _dev(self, handle: Handle, function: str) -> _Device:
        self._ready()
        if not isinstance(handle, Handle) or not 0 <= handle.index < self.count:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self.calls[(function, handle.index)] += 1
        dev = self._devices[handle.index]
        if dev.lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if handle.mig is not None and function not in _MIG_HANDLE_FUNCTIONS:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        unsupported = self.profile.not_supported | dev.not_supported
        if self.profile.mig:
            unsupported = unsupported | self.profile.mig_not_supported
        if function in unsupported:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if self.profile.mig and handle.mig is None and function in _PARENT_NEEDS_ROOT_UNDER_MIG:
            raise nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)
        return dev

    def _t(self) -> float:
        return self._clock() - self._t0

    def _procs_on(self, index: int) -> list[tuple[int, int]]:
        """(pid, local_rank) of the target processes on GPU ``index``."""
        return sorted((pid, lr) for pid, lr in self._targets.items() if lr % self.count == index)

    def _util(self, index: int) -> float:
        """0..1: steady around 88% (a healthy job: no dips, nothing for a finding), or 0."""
        if not self._procs_on(index):
            return 0.0
        t = self._t() + 1.7 * index
        return 0.88 + 0.02 * math.sin(2 * math.pi * t / 7.0) + 0.01 * math.sin(2 * math.pi * t / 0.9)

    def _power_mw(self, index: int) -> float:
        p = self.profile
        return p.power_idle_mw + (0.88 * p.power_limit_mw - p.power_idle_mw) * self._util(index)

    def _advance(self, dev: _Device) -> None:
        """Integrate the counters up to now (they only ever go up)."""
        now = self._clock()
        dt = max(0.0, now - dev.last_t)
        dev.last_t = max(dev.last_t, now)
        u = self._util(dev.index)
        dev.energy_mj += self._power_mw(dev.index) * dt
        rate_kib = self.profile.nvlink_bytes_per_second * 0.3 * u / 1024.0
        dev.nvlink_tx_kib += rate_kib * dt
        dev.nvlink_rx_kib += rate_kib * 0.97 * dt

    def _proc_memory(self, pid: int, local_rank: int) -> int:
        limit = self.profile.mig[local_rank % len(self.profile.mig)].memory_total if self.profile.mig else self.profile.memory_total
        ramp = min(1.0, 0.2 + self._t() / 10.0)  # allocator warm-up over the first seconds
        return int(limit * (0.55 + 0.02 * (pid % 5)) * ramp) // MIB * MIB

    # -- system ---------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if self._init_error is not None:
            raise nvml_error(self._init_error)
        self._refcount += 1

    def nvmlShutdown(self) -> None:
        self._ready()
        self._refcount -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._ready()
        return DRIVER_VERSION

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._ready()
        return NVML_VERSION

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._ready()
        return CUDA_DRIVER_VERSION

    def nvmlDeviceGetCount(self) -> int:
        self._ready()
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        self._ready()
        if not 0 <= index < self.count:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self._devices[index].lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._devices[index].handle

    # -- identity -------------------------------------------------------------------
    def nvmlDeviceGetName(self, handle: Handle) -> str:
        self._dev(handle, "nvmlDeviceGetName")
        if handle.mig is not None:
            return f"{self.profile.name} MIG {handle.mig.profile}"
        return self.profile.name

    def nvmlDeviceGetUUID(self, handle: Handle) -> str:
        dev = self._dev(handle, "nvmlDeviceGetUUID")
        if handle.mig is not None:
            return "MIG-" + _uuid(f"{dev.uuid}/{handle.mig.gi}/{handle.mig.ci}")
        return dev.uuid

    def nvmlDeviceGetPciInfo(self, handle: Handle) -> pynvml.nvmlPciInfo_t:
        self._dev(handle, "nvmlDeviceGetPciInfo")
        buses = self.profile.pci_buses
        bus = buses[handle.index % len(buses)] + 0x100 * (handle.index // len(buses))
        info = pynvml.nvmlPciInfo_t()
        info.domain, info.bus, info.device = 0, bus, 0
        info.busId = f"00000000:{bus:02X}:00.0".encode()
        info.busIdLegacy = f"0000:{bus:02X}:00.0".encode()
        info.pciDeviceId = 0x233010DE if "H100" in self.profile.name else 0x20B210DE
        return info

    # -- MIG --------------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, handle: Handle) -> list[int]:
        self._dev(handle, "nvmlDeviceGetMigMode")
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if self.profile.mig else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Handle) -> int:
        self._dev(handle, "nvmlDeviceGetMaxMigDeviceCount")
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Handle, index: int) -> Handle:
        self._dev(handle, "nvmlDeviceGetMigDeviceHandleByIndex")
        if not self.profile.mig:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not 0 <= index < len(self.profile.mig):
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return Handle(handle.index, self.profile.mig[index])

    def nvmlDeviceGetGpuInstanceId(self, handle: Handle) -> int:
        self._dev(handle, "nvmlDeviceGetGpuInstanceId")
        if handle.mig is None:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle.mig.gi

    def nvmlDeviceGetComputeInstanceId(self, handle: Handle) -> int:
        self._dev(handle, "nvmlDeviceGetComputeInstanceId")
        if handle.mig is None:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle.mig.ci

    # -- utilisation, memory ------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle: Handle) -> pynvml.c_nvmlUtilization_t:
        self._dev(handle, "nvmlDeviceGetUtilizationRates")
        u = self._util(handle.index)
        out = pynvml.c_nvmlUtilization_t()
        out.gpu, out.memory = round(100 * u), round(100 * u * 0.55)
        return out

    def nvmlDeviceGetMemoryInfo(self, handle: Handle, version: int | None = None):  # noqa: ANN201 - v1 or v2 struct
        self._dev(handle, "nvmlDeviceGetMemoryInfo")
        if handle.mig is not None:
            total = handle.mig.memory_total
            reserved = 0
            used = sum(self._proc_memory(pid, lr) for pid, lr in self._procs_on(handle.index) if self.profile.mig[lr % len(self.profile.mig)] == handle.mig)
        else:
            total = self.profile.memory_total
            reserved = self.profile.memory_reserved
            used = sum(self._proc_memory(pid, lr) for pid, lr in self._procs_on(handle.index))
        if version:
            v2 = pynvml.c_nvmlMemory_v2_t()
            v2.version, v2.total, v2.reserved, v2.used = version, total, reserved, used
            v2.free = total - reserved - used
            return v2
        v1 = pynvml.c_nvmlMemory_t()
        v1.total, v1.used = total, used + reserved
        v1.free = total - v1.used
        return v1

    # -- power, thermals, clocks ------------------------------------------------------------
    def nvmlDeviceGetPowerUsage(self, handle: Handle) -> int:
        self._dev(handle, "nvmlDeviceGetPowerUsage")
        return int(self._power_mw(handle.index))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Handle) -> int:
        self._dev(handle, "nvmlDeviceGetEnforcedPowerLimit")
        return self.profile.power_limit_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Handle) -> int:
        dev = self._dev(handle, "nvmlDeviceGetTotalEnergyConsumption")
        self._advance(dev)
        return int(dev.energy_mj)

    def nvmlDeviceGetTemperature(self, handle: Handle, sensor: int) -> int:
        self._dev(handle, "nvmlDeviceGetTemperature")
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return round(31 + 2 * handle.index % 5 + 40 * self._util(handle.index))

    def nvmlDeviceGetClockInfo(self, handle: Handle, clock_type: int) -> int:
        self._dev(handle, "nvmlDeviceGetClockInfo")
        p = self.profile
        if clock_type == pynvml.NVML_CLOCK_SM:
            u = self._util(handle.index)
            return p.sm_clock_max_mhz if u > 0.2 else p.sm_clock_idle_mhz
        if clock_type == pynvml.NVML_CLOCK_MEM:
            return p.memory_clock_mhz
        raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetPerformanceState(self, handle: Handle) -> int:
        self._dev(handle, "nvmlDeviceGetPerformanceState")
        return 0  # datacenter boards in persistence mode stay in P0

    def nvmlDeviceGetFanSpeed(self, handle: Handle) -> int:
        self._dev(handle, "nvmlDeviceGetFanSpeed")
        return round(30 + 50 * self._util(handle.index))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Handle) -> int:
        self._dev(handle, "nvmlDeviceGetCurrentClocksEventReasons")
        u = self._util(handle.index)
        if u == 0.0:
            return pynvml.nvmlClocksEventReasonGpuIdle
        return pynvml.nvmlClocksEventReasonNone  # healthy: power stays below the cap (see _power_mw)

    def nvmlDeviceGetPcieThroughput(self, handle: Handle, counter: int) -> int:
        """KB/s over the last 20 ms, as in NVML."""
        self._dev(handle, "nvmlDeviceGetPcieThroughput")
        u = self._util(handle.index)
        share = 0.04 if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else 0.09
        return int(self.profile.pcie_bytes_per_second * share * u / 1000) + 120

    # -- reliability ---------------------------------------------------------------------
    def nvmlDeviceGetTotalEccErrors(self, handle: Handle, error_type: int, counter_type: int) -> int:
        self._dev(handle, "nvmlDeviceGetTotalEccErrors")
        if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return int(self._t() // 900) + (1 if counter_type == pynvml.NVML_AGGREGATE_ECC else 0)
        return 0

    def nvmlDeviceGetRetiredPages(self, handle: Handle, cause: int) -> list[int]:
        self._dev(handle, "nvmlDeviceGetRetiredPages")
        return []

    def nvmlDeviceGetRemappedRows(self, handle: Handle) -> tuple[int, int, int, int]:
        self._dev(handle, "nvmlDeviceGetRemappedRows")
        return (0, 0, 0, 0)

    def nvmlDeviceGetFieldValues(self, handle: Handle, field_ids: list) -> list:  # noqa: ANN401
        dev = self._dev(handle, "nvmlDeviceGetFieldValues")
        self._advance(dev)
        out = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for v, fid in zip(out, field_ids, strict=True):
            fid, scope = fid if isinstance(fid, tuple) else (fid, 0)
            v.fieldId, v.scopeId, v.nvmlReturn = fid, scope, pynvml.NVML_SUCCESS
            v.timestamp = int(self._wall() * 1e6)
            if fid == pynvml.NVML_FI_DEV_MEMORY_TEMP:
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                v.value.uiVal = round(38 + 30 * self._util(handle.index))
            elif fid == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX:
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                v.value.ullVal = int(dev.nvlink_tx_kib)
            elif fid == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX:
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                v.value.ullVal = int(dev.nvlink_rx_kib)
            else:
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return out

    # -- processes ---------------------------------------------------------------------------
    def _process_infos(self, handle: Handle) -> list:
        out = []
        for pid, lr in self._procs_on(handle.index):
            gi = ci = NOT_AVAILABLE_UINT
            if self.profile.mig:
                s = self.profile.mig[lr % len(self.profile.mig)]
                if handle.mig is not None and handle.mig != s:
                    continue
                gi, ci = s.gi, s.ci
            info = _PROCESS_INFO()
            info.pid, info.usedGpuMemory = pid, self._proc_memory(pid, lr)
            info.gpuInstanceId, info.computeInstanceId = gi, ci
            friendly = pynvml.nvmlStructToFriendlyObject(info)
            if self.profile.mig:
                friendly.usedGpuMemory = None  # NVML_VALUE_NOT_AVAILABLE on MIG-enabled GPUs; pynvml says None
            out.append(friendly)
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Handle) -> list:
        self._dev(handle, "nvmlDeviceGetComputeRunningProcesses")
        return self._process_infos(handle)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Handle) -> list:
        self._dev(handle, "nvmlDeviceGetGraphicsRunningProcesses")
        return []  # training processes are compute contexts

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Handle) -> list:
        self._dev(handle, "nvmlDeviceGetMPSComputeRunningProcesses")
        return []  # no MPS daemon on the simulated node

    def nvmlDeviceGetProcessUtilization(self, handle: Handle, last_seen: int) -> list:
        """Samples newer than ``last_seen`` (µs); NVMLError_NotFound when there are none."""
        self._dev(handle, "nvmlDeviceGetProcessUtilization")
        now_us = int(self._wall() * 1e6)
        procs = self._procs_on(handle.index)
        u = self._util(handle.index)
        if not procs or now_us <= last_seen or u == 0.0:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        out = []
        for pid, _ in procs:
            s = pynvml.c_nvmlProcessUtilizationSample_t()
            s.pid, s.timeStamp = pid, now_us
            s.smUtil, s.memUtil = round(100 * u / len(procs)), round(55 * u / len(procs))
            out.append(s)
        return out

    # -- events --------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> EventSet:
        self._ready()
        es = EventSet()
        self._event_sets.append(es)
        return es

    def nvmlDeviceRegisterEvents(self, handle: Handle, event_types: int, event_set: EventSet) -> None:
        self._dev(handle, "nvmlDeviceRegisterEvents")
        if event_types & pynvml.nvmlEventTypeXidCriticalError:
            event_set.devices.add(handle.index)

    def nvmlEventSetWait_v2(self, event_set: EventSet, timeout_ms: int) -> EventData:
        """Never blocks: the next queued event, else NVMLError_Timeout."""
        self._ready()
        if not event_set.queue:
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)
        return event_set.queue.pop(0)

    def nvmlEventSetFree(self, event_set: EventSet) -> None:
        self._ready()
        if event_set in self._event_sets:
            self._event_sets.remove(event_set)

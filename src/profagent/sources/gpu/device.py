"""Reading one device through the Nvml entry point: identity, MIG layout, and the values
of one tick. Every field is read on its own; what a device does not support is simply
missing from the result (never 0)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pynvml

from profagent.contracts import MigDevice
from profagent.sources.gpu.nvml import Nvml, text

NOT_AVAILABLE_UINT = 0xFFFFFFFF
ALL_LINKS = 0xFFFFFFFF  # scopeId: the sum over every NVLink

# Closed set for the `reason` label of profagent_gpu_clock_event_reason_active.
CLOCK_EVENT_REASONS: dict[str, int] = {
    "gpu_idle": pynvml.nvmlClocksEventReasonGpuIdle,
    "applications_clocks_setting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
    "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
    "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
    "sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
    "sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
    "hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
    "hw_power_brake_slowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
    "display_clock_setting": pynvml.nvmlClocksEventReasonDisplayClockSetting,
}

FIELD_IDS: dict[str, tuple[int, int]] = {
    "memory_temperature_celsius": (pynvml.NVML_FI_DEV_MEMORY_TEMP, 0),
    "nvlink_tx_bytes": (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),  # KiB counters
    "nvlink_rx_bytes": (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
}



@dataclass
class DeviceHandle:
    """What is known of one physical device between ticks (owned by the source)."""

    index: int
    handle: Any = None
    uuid: str = ""
    name: str = ""
    pci_bus_id: str = ""
    mig_mode: str = ""  # "enabled", "disabled", or "" when MIG is not supported
    mig_handles: list[tuple[int, int, str, str, Any]] = field(default_factory=list)  # gi, ci, uuid, name, handle
    lost: bool = False  # down at the last tick: identify again, renew its XID registration

    @property
    def key(self) -> str:
        return self.uuid or f"index-{self.index}"


def identify(nvml: Nvml, dev: DeviceHandle) -> None:
    """Fill in handle, UUID, name, PCI bus and the MIG layout. Raises DeviceLost."""
    handle = nvml.call("nvmlDeviceGetHandleByIndex", dev.index, device_level=True)
    dev.uuid = text(nvml.call("nvmlDeviceGetUUID", handle, device_level=True))
    dev.handle = handle
    k = dev.key
    dev.name = text(nvml.read(k, "name", "nvmlDeviceGetName", dev.handle) or "")
    pci = nvml.read(k, "pci", "nvmlDeviceGetPciInfo", dev.handle)
    dev.pci_bus_id = text(pci.busId) if pci is not None else ""
    mode = nvml.read(k, "mig_mode", "nvmlDeviceGetMigMode", dev.handle)
    dev.mig_mode = "" if mode is None else ("enabled" if mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE else "disabled")
    dev.mig_handles = []
    if dev.mig_mode != "enabled":
        return
    slots = nvml.read(k, "mig_count", "nvmlDeviceGetMaxMigDeviceCount", dev.handle) or 0
    for slot in range(slots):
        h = nvml.read(k, "mig_handle", "nvmlDeviceGetMigDeviceHandleByIndex", dev.handle, slot)
        if h is None:
            continue  # empty slot (NotFound)
        gi = nvml.read(k, "mig_gi", "nvmlDeviceGetGpuInstanceId", h)
        ci = nvml.read(k, "mig_ci", "nvmlDeviceGetComputeInstanceId", h)
        uuid = text(nvml.read(k, "mig_uuid", "nvmlDeviceGetUUID", h) or "")
        name = text(nvml.read(k, "mig_name", "nvmlDeviceGetName", h) or "")
        if gi is not None:
            dev.mig_handles.append((gi, ci if ci is not None else 0, uuid, name, h))


def _memory(nvml: Nvml, key: str, handle: Any, prefix: str = "") -> dict[str, float]:
    """v2 memory info (with ``reserved``), else v1."""
    out: dict[str, float] = {}
    mem = nvml.read(key, prefix + "memory_v2", "nvmlDeviceGetMemoryInfo", handle, pynvml.nvmlMemory_v2)
    if mem is not None:
        out["memory_reserved_bytes"] = mem.reserved
    elif not nvml.supported(key, prefix + "memory_v2"):
        mem = nvml.read(key, prefix + "memory_v1", "nvmlDeviceGetMemoryInfo", handle)
    if mem is not None:
        out["memory_used_bytes"] = mem.used
        out["memory_free_bytes"] = mem.free
        out["memory_total_bytes"] = mem.total
    return out


def read_values(nvml: Nvml, dev: DeviceHandle) -> dict[str, float]:
    """This tick's device values by name (see the renderer); absent ones are missing.
    Raises DeviceLost or SourceUnavailable."""
    k, h, r = dev.key, dev.handle, nvml.read
    v: dict[str, float] = {}
    util = r(k, "utilization", "nvmlDeviceGetUtilizationRates", h)
    if util is not None:
        v["utilization_ratio"] = util.gpu / 100.0
        v["memory_utilization_ratio"] = util.memory / 100.0
    v.update(_memory(nvml, k, h))

    scaled: list[tuple[str, str, tuple[Any, ...], float]] = [
        ("power_usage_watts", "nvmlDeviceGetPowerUsage", (), 1e-3),
        ("power_limit_watts", "nvmlDeviceGetEnforcedPowerLimit", (), 1e-3),
        ("energy_joules", "nvmlDeviceGetTotalEnergyConsumption", (), 1e-3),
        ("temperature_celsius", "nvmlDeviceGetTemperature", (pynvml.NVML_TEMPERATURE_GPU,), 1.0),
        ("sm_clock_hertz", "nvmlDeviceGetClockInfo", (pynvml.NVML_CLOCK_SM,), 1e6),
        ("memory_clock_hertz", "nvmlDeviceGetClockInfo", (pynvml.NVML_CLOCK_MEM,), 1e6),
        ("fan_speed_ratio", "nvmlDeviceGetFanSpeed", (), 1e-2),
        # NVML documents KB/s here (and KiB where it means KiB, e.g. NVLink counters).
        ("pcie_tx_bytes_per_second", "nvmlDeviceGetPcieThroughput", (pynvml.NVML_PCIE_UTIL_TX_BYTES,), 1000.0),
        ("pcie_rx_bytes_per_second", "nvmlDeviceGetPcieThroughput", (pynvml.NVML_PCIE_UTIL_RX_BYTES,), 1000.0),
        ("ecc_corrected_errors", "nvmlDeviceGetTotalEccErrors",
         (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC), 1.0),
        ("ecc_uncorrected_errors", "nvmlDeviceGetTotalEccErrors",
         (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC), 1.0),
    ]
    for name, function, args, scale in scaled:
        value = r(k, name, function, h, *args)
        if value is not None:
            v[name] = value * scale

    pstate = r(k, "performance_state", "nvmlDeviceGetPerformanceState", h)
    if pstate is not None and 0 <= pstate <= 15:  # 32 = unknown
        v["performance_state"] = pstate
    for name, cause in (
        ("retired_pages_single_bit", pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS),
        ("retired_pages_double_bit", pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR),
    ):
        pages = r(k, name, "nvmlDeviceGetRetiredPages", h, cause)
        if pages is not None:
            v[name] = len(pages)
    rows = r(k, "remapped_rows", "nvmlDeviceGetRemappedRows", h)
    if rows is not None:
        corr, unc, pending, failure = rows
        v["remapped_rows_correctable"] = corr
        v["remapped_rows_uncorrectable"] = unc
        v["row_remap_pending"] = 1.0 if pending else 0.0
        v["row_remap_failed"] = 1.0 if failure else 0.0
    fields = nvml.fields(k, h, FIELD_IDS)
    for name, value in fields.items():
        v[name] = value * 1024.0 if name.startswith("nvlink_") else value
    return v


PROCESS_LISTS: tuple[tuple[str, str], ...] = (
    ("compute_processes", "nvmlDeviceGetComputeRunningProcesses"),
    ("graphics_processes", "nvmlDeviceGetGraphicsRunningProcesses"),
    ("mps_processes", "nvmlDeviceGetMPSComputeRunningProcesses"),  # MPS clients
)


def list_processes(nvml: Nvml, dev: DeviceHandle) -> dict[int, tuple[int | None, int]] | None:
    """pid -> (GPU memory or None, GPU instance id) of every process with a context on
    the device; None when NVML lists none of the kinds here.

    Under MIG the lists are read through each MIG device handle (NVML answers the parent
    handle only to root); the GPU instance comes from the handle, and the memory is None
    where NVML leaves ``usedGpuMemory`` unavailable. Without MIG handles the parent is
    asked."""
    sources: list[tuple[str, Any, int | None]] = [
        (f"mig{gi}.{ci}.", h, gi) for gi, ci, _, _, h in dev.mig_handles
    ] if dev.mig_mode == "enabled" else []
    listed: dict[int, tuple[int | None, int]] = {}
    answered = False
    for prefix, handle, mig_gi in sources or [("", dev.handle, None)]:
        for field_name, function in PROCESS_LISTS:
            procs = nvml.read(dev.key, prefix + field_name, function, handle, not_found=[])
            if procs is None:
                continue
            answered = True
            for p in procs:
                memory = getattr(p, "usedGpuMemory", None)
                gi = mig_gi if mig_gi is not None else getattr(p, "gpuInstanceId", NOT_AVAILABLE_UINT)
                old = listed.get(p.pid)
                if old is not None and old[0] is not None and (memory is None or memory < old[0]):
                    memory = old[0]  # e.g. an MPS server listed as compute too: keep the larger
                listed[p.pid] = (memory, gi)
    return listed if answered else None


def read_clock_event_reasons(nvml: Nvml, dev: DeviceHandle) -> dict[str, bool]:
    """Each known reason -> active; {} when unsupported. Older drivers: throttle reasons."""
    k, h = dev.key, dev.handle
    mask = nvml.read(k, "clock_event_reasons", "nvmlDeviceGetCurrentClocksEventReasons", h)
    if mask is None and not nvml.supported(k, "clock_event_reasons"):
        mask = nvml.read(k, "clock_throttle_reasons", "nvmlDeviceGetCurrentClocksThrottleReasons", h)
    if mask is None:
        return {}
    return {name: bool(mask & bit) for name, bit in CLOCK_EVENT_REASONS.items()}


def read_mig(nvml: Nvml, dev: DeviceHandle) -> tuple[MigDevice, ...]:
    out = []
    for gi, ci, uuid, name, h in dev.mig_handles:
        mem = _memory(nvml, dev.key, h, prefix=f"mig{gi}.{ci}.")
        out.append(
            MigDevice(
                gi, ci, uuid, name,
                memory_total=_int(mem.get("memory_total_bytes")),
                memory_used=_int(mem.get("memory_used_bytes")),
                memory_free=_int(mem.get("memory_free_bytes")),
            )
        )
    return tuple(out)


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)

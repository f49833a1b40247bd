"""A simulated NVML scripted by the same YAML as NVIDIA's mock NVML.

``--gpu-backend simulated:PATH.yaml`` runs the production source on ``ScriptedNvml``, so one
contract suite runs unchanged on both backends (tests/e2e/test_gpu_contract.py).
"""

from __future__ import annotations

import copy
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pynvml
import yaml

from profagent.errors import UserError
from profagent.sources.gpu.simulated import (
    NOT_AVAILABLE_UINT,
    EventData,
    EventSet,
    Handle,
    nvml_error,
)

MIB = 1024 * 1024
_LOST_MODES = ("lost", "fallen_off_bus")
_REASON_BITS = {
    "gpu_idle": pynvml.nvmlClocksEventReasonGpuIdle,
    "applications_clocks_setting": pynvml.nvmlClocksEventReasonApplicationsClocksSetting,
    "sw_power_cap": pynvml.nvmlClocksEventReasonSwPowerCap,
    "hw_slowdown": pynvml.nvmlClocksEventReasonHwSlowdown,
    "sync_boost": pynvml.nvmlClocksEventReasonSyncBoost,
    "sw_thermal_slowdown": pynvml.nvmlClocksEventReasonSwThermalSlowdown,
    "hw_thermal_slowdown": pynvml.nvmlClocksEventReasonHwThermalSlowdown,
    "hw_power_brake_slowdown": pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
    "display_clocks_setting": pynvml.nvmlClocksEventReasonDisplayClockSetting,
}
_PROCESS_INFO = getattr(pynvml, "c_nvmlProcessInfo_v3_t", None) or pynvml.c_nvmlProcessInfo_t


def merge(base: Any, over: Any) -> Any:
    """Deep merge of mappings; anything else (lists too) is replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(base.get(k), v)
        return out
    return copy.deepcopy(over)


def parse_ttl(text: str | None) -> float:
    """``200ms``, ``1s``, ``1.5`` (seconds) -> seconds; default 1 s."""
    if not text:
        return 1.0
    m = re.fullmatch(r"\s*([0-9.]+)\s*(ms|s)?\s*", text)
    if not m:
        return 1.0
    value = float(m.group(1))
    return value / 1000.0 if m.group(2) == "ms" else value


def load_config(path: Path) -> dict:
    """The mock configuration; raises UserError naming the file."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise UserError(f"cannot read GPU script {path} ({exc.strerror})", "give a mock NVML YAML file, e.g. ../shared/nvml-mock/configs/mock-nvml-config-h100.yaml") from None
    except yaml.YAMLError as exc:
        raise UserError(f"GPU script {path} is not valid YAML ({str(exc).splitlines()[0]})", "fix the file") from None
    if not isinstance(data, dict) or not isinstance(data.get("devices"), list) or not data["devices"]:
        raise UserError(f"GPU script {path} lists no devices", "add a devices: list (see the mock NVML configs)")
    return data


class _State:
    """Per device: guarded-call count and failure bookkeeping."""

    def __init__(self) -> None:
        self.calls = 0
        self.failure_key: str = ""
        self.tripped = False
        self.ecc_extra = 0
        self.xid_pending = False


# ``--gpu-backend simulated:PATH.yaml`` runs the production source on ``ScriptedNvml``:
# devices, values, processes, per-process utilisation and failures come from a mock NVML
# configuration file (``device_defaults`` merged under each ``devices`` entry), and runtime
# changes from ``overrides.yaml`` next to it (or ``MOCK_NVML_OVERRIDES``), re-read every
# ``MOCK_NVML_OVERRIDES_TTL`` (Go duration such as ``200ms``, or seconds; default 1 s) and
# deep-merged over the configuration (``all``, then ``devices["N"]``). Deleting the file
# restores the configuration. The same file therefore drives both backends, so one contract
# suite runs unchanged on both (tests/e2e/test_gpu_contract.py).
#
# It answers what NVML documents and the mock does: no per-process utilisation sample for a
# process whose ``sm_util`` and ``mem_util`` are 0 (``NOT_FOUND`` when there is none),
# PCIe throughput in KB/s, ``failure: {mode: lost | fallen_off_bus}`` answering
# GPU_IS_LOST to every call (the handle lookup too) once ``after_calls`` device calls have
# been made, ``ecc_uncorrectable`` making the uncorrected ECC counter grow and delivering
# ``xid.code`` once to the event sets the device is registered with. A lost device leaves
# the event sets (a driver forgets the registration); removing the failure brings the GPU
# back. Not modelled: ``probability``, ``dynamic_metrics``, MIG, MPS, NVLink traffic.
class ScriptedNvml:
    """pynvml's functions, answered from a mock NVML YAML configuration."""

    def __init__(self, config_path: str | Path, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.path = Path(config_path)
        self.config = load_config(self.path)
        self.count = min(8, len(self.config["devices"]))  # the mock's limit too
        self.overrides_path = Path(os.environ.get("MOCK_NVML_OVERRIDES") or self.path.with_name("overrides.yaml"))
        self.ttl = parse_ttl(os.environ.get("MOCK_NVML_OVERRIDES_TTL"))
        self._clock, self._wall = clock, wall
        self._overrides: dict = {}
        self._merged: dict[int, dict] = {}  # device index -> merged configuration
        self._read_at: float | None = None
        self._refcount = 0
        self._handles = [Handle(i) for i in range(self.count)]
        self._state = [_State() for _ in range(self.count)]
        self._event_sets: list[EventSet] = []

    # -- configuration -----------------------------------------------------------------
    def _refresh(self) -> None:
        now = self._clock()
        if self._read_at is not None and now - self._read_at < self.ttl:
            return
        self._read_at = now
        try:
            data = yaml.safe_load(self.overrides_path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            data = {}
        data = data if isinstance(data, dict) else {}
        if data != self._overrides:
            self._overrides, self._merged = data, {}

    def device_config(self, index: int) -> dict:
        """The merged configuration of device ``index`` right now."""
        self._refresh()
        cfg = self._merged.get(index)
        if cfg is None:
            cfg = merge(self.config.get("device_defaults") or {}, self.config["devices"][index])
            cfg = merge(cfg, self._overrides.get("all") or {})
            cfg = self._merged[index] = merge(cfg, (self._overrides.get("devices") or {}).get(str(index)) or {})
        return cfg

    def _guard(self, handle: Any, counted: bool = True) -> dict:
        """The device's configuration, after applying its failure injection."""
        if self._refcount <= 0:
            raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)
        if not isinstance(handle, Handle) or not 0 <= handle.index < self.count:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        cfg = self.device_config(handle.index)
        st = self._state[handle.index]
        failure = cfg.get("failure") or {}
        mode = failure.get("mode", "healthy")
        key = repr(sorted(failure.items())) if mode != "healthy" else ""
        if key != st.failure_key:  # a new (or removed) failure: the device starts over
            st.failure_key, st.calls, st.tripped, st.xid_pending = key, 0, False, False
        if counted:
            st.calls += 1
        if key and not st.tripped and st.calls >= int(failure.get("after_calls") or 0):
            st.tripped = True
            if mode in _LOST_MODES:
                for es in self._event_sets:  # the driver forgets a lost device's registration
                    es.devices.discard(handle.index)
            elif (failure.get("xid") or {}).get("code") is not None:
                st.xid_pending = True
        if st.tripped and mode in _LOST_MODES:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if st.tripped and mode == "ecc_uncorrectable":
            st.ecc_extra += 1
        return cfg

    # -- test hook of the Nvml wrapper ---------------------------------------------------
    def simulatedSetTargetProcesses(self, procs: Iterable[tuple[int, int]]) -> None:
        """No-op: the script names its processes."""

    # -- system --------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self._refcount += 1

    def nvmlShutdown(self) -> None:
        if self._refcount <= 0:
            raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)
        self._refcount -= 1

    def _system(self, key: str, default: Any) -> Any:
        if self._refcount <= 0:
            raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)
        return (self.config.get("system") or {}).get(key, default)

    def nvmlSystemGetDriverVersion(self) -> str:
        return str(self._system("driver_version", "550.163.01"))

    def nvmlSystemGetNVMLVersion(self) -> str:
        return str(self._system("nvml_version", "12.550.163.01"))

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return int(self._system("cuda_version_major", 12)) * 1000 + int(self._system("cuda_version_minor", 4)) * 10

    def nvmlDeviceGetCount(self) -> int:
        self._system("driver_version", "")
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        if not 0 <= index < self.count:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._guard(self._handles[index], counted=False)
        return self._handles[index]

    # -- identity ------------------------------------------------------------------------
    def nvmlDeviceGetUUID(self, handle: Handle) -> str:
        return str(self._guard(handle).get("uuid") or f"GPU-{handle.index:08d}")

    def nvmlDeviceGetName(self, handle: Handle) -> str:
        return str(self._guard(handle).get("name") or "NVIDIA GPU")

    def nvmlDeviceGetPciInfo(self, handle: Handle) -> pynvml.nvmlPciInfo_t:
        bus_id = str((self._guard(handle).get("pci") or {}).get("bus_id") or f"0000:{handle.index:02X}:00.0")
        info = pynvml.nvmlPciInfo_t()
        info.busIdLegacy = bus_id.encode()
        info.busId = ("0000" + bus_id).encode()  # NVML's 8-digit domain
        return info

    def nvmlDeviceGetMigMode(self, handle: Handle) -> list[int]:
        mig = self._guard(handle).get("mig") or {}
        cur = pynvml.NVML_DEVICE_MIG_ENABLE if mig.get("mode_current") == "enabled" else pynvml.NVML_DEVICE_MIG_DISABLE
        pend = pynvml.NVML_DEVICE_MIG_ENABLE if mig.get("mode_pending") == "enabled" else pynvml.NVML_DEVICE_MIG_DISABLE
        return [cur, pend]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Handle) -> int:
        return int((self._guard(handle).get("mig") or {}).get("max_gpu_instances", 7))

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Handle, index: int) -> Handle:
        self._guard(handle)
        raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)  # MIG devices are not scripted (as in the mock)

    # -- values --------------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle: Handle) -> pynvml.c_nvmlUtilization_t:
        util = self._guard(handle).get("utilization") or {}
        out = pynvml.c_nvmlUtilization_t()
        out.gpu, out.memory = int(util.get("gpu", 0)), int(util.get("memory", 0))
        return out

    def nvmlDeviceGetMemoryInfo(self, handle: Handle, version: int | None = None):  # noqa: ANN201 - v1 or v2 struct
        mem = self._guard(handle).get("memory") or {}
        total, reserved = int(mem.get("total_bytes", 0)), int(mem.get("reserved_bytes", 0))
        used = int(mem.get("used_bytes", 0))
        free = int(mem.get("free_bytes", total - reserved - used))
        if version:
            v2 = pynvml.c_nvmlMemory_v2_t()
            v2.version, v2.total, v2.reserved, v2.used, v2.free = version, total, reserved, used, free
            return v2
        v1 = pynvml.c_nvmlMemory_t()
        v1.total, v1.used, v1.free = total, used, free
        return v1

    def nvmlDeviceGetPowerUsage(self, handle: Handle) -> int:
        return int((self._guard(handle).get("power") or {}).get("current_draw_mw", 0))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Handle) -> int:
        power = self._guard(handle).get("power") or {}
        return int(power.get("enforced_limit_mw", power.get("default_limit_mw", 0)))

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Handle) -> int:
        return int((self._guard(handle).get("power") or {}).get("total_energy_consumption_mj", 0))

    def nvmlDeviceGetTemperature(self, handle: Handle, sensor: int) -> int:
        return int((self._guard(handle).get("thermal") or {}).get("temperature_gpu_c", 0))

    def nvmlDeviceGetClockInfo(self, handle: Handle, clock_type: int) -> int:
        clocks = self._guard(handle).get("clocks") or {}
        key = {pynvml.NVML_CLOCK_SM: "sm_current", pynvml.NVML_CLOCK_MEM: "memory_current",
               pynvml.NVML_CLOCK_GRAPHICS: "graphics_current"}.get(clock_type)
        if key is None or key not in clocks:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(clocks[key])

    def nvmlDeviceGetPerformanceState(self, handle: Handle) -> int:
        state = str(self._guard(handle).get("performance_state", "P0"))
        return int(state.lstrip("P")) if state.lstrip("P").isdigit() else 32

    def nvmlDeviceGetFanSpeed(self, handle: Handle) -> int:
        fan = self._guard(handle).get("fan") or {}
        if not fan.get("count") or not str(fan.get("speed_percent", "")).isdigit():
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(fan["speed_percent"])

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Handle) -> int:
        reasons = self._guard(handle).get("clocks_throttle_reasons") or {}
        return sum(bit for name, bit in _REASON_BITS.items() if reasons.get(name))

    def nvmlDeviceGetPcieThroughput(self, handle: Handle, counter: int) -> int:
        """KB/s, as NVML documents."""
        pcie = self._guard(handle).get("pcie") or {}
        key = "tx_throughput_kbps" if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else "rx_throughput_kbps"
        return int(pcie.get(key, 0))

    def nvmlDeviceGetTotalEccErrors(self, handle: Handle, error_type: int, counter_type: int) -> int:
        cfg = self._guard(handle)
        ecc = cfg.get("ecc") or {}
        if ecc.get("mode_current", "enabled") != "enabled":
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        scope = "volatile" if counter_type == pynvml.NVML_VOLATILE_ECC else "aggregate"
        kind = "single_bit" if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else "double_bit"
        base = int((((ecc.get("errors") or {}).get(scope) or {}).get(kind) or {}).get("total", 0))
        if kind == "double_bit":
            base += self._state[handle.index].ecc_extra
        return base

    def nvmlDeviceGetRetiredPages(self, handle: Handle, cause: int) -> list[int]:
        pages = self._guard(handle).get("retired_pages") or {}
        kind = "double_bit_retirement" if cause == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR else "single_bit_retirement"
        return list((pages.get(kind) or {}).get("addresses") or [])

    def nvmlDeviceGetRemappedRows(self, handle: Handle) -> tuple[int, int, int, int]:
        rows = self._guard(handle).get("remapped_rows") or {}
        unc = int(rows.get("uncorrectable", 0)) + (1 if self._state[handle.index].ecc_extra else 0)
        return (int(rows.get("correctable", 0)), unc, int(bool(rows.get("pending"))), int(bool(rows.get("failure_occurred"))))

    def nvmlDeviceGetFieldValues(self, handle: Handle, field_ids: list) -> Any:  # noqa: ANN401 - ctypes array
        cfg = self._guard(handle)
        out = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for v, fid in zip(out, field_ids, strict=True):
            fid, scope = fid if isinstance(fid, tuple) else (fid, 0)
            v.fieldId, v.scopeId, v.nvmlReturn = fid, scope, pynvml.NVML_SUCCESS
            v.timestamp = int(self._wall() * 1e6)
            if fid == pynvml.NVML_FI_DEV_MEMORY_TEMP and "temperature_memory_c" in (cfg.get("thermal") or {}):
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                v.value.uiVal = int(cfg["thermal"]["temperature_memory_c"])
            elif fid in (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX):
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                v.value.ullVal = 0  # no traffic is scripted (the mock reports 0 too)
            else:
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return out

    # -- processes ---------------------------------------------------------------------------
    def _processes(self, handle: Handle, kind: str) -> list:
        out = []
        for p in self._guard(handle).get("processes") or []:
            if str(p.get("type", "C")).upper() != kind:
                continue
            info = _PROCESS_INFO()
            info.pid, info.usedGpuMemory = int(p["pid"]), int(p.get("used_memory_mib", 0)) * MIB
            info.gpuInstanceId = info.computeInstanceId = NOT_AVAILABLE_UINT
            out.append(pynvml.nvmlStructToFriendlyObject(info))
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Handle) -> list:
        return self._processes(handle, "C")

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Handle) -> list:
        return self._processes(handle, "G")

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Handle) -> list:
        self._guard(handle)
        raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)  # MPS is not scripted (nor in the mock)

    def nvmlDeviceGetProcessUtilization(self, handle: Handle, last_seen: int) -> list:
        """A sample per process that did work, stamped now; NOT_FOUND when none did."""
        now_us = int(self._wall() * 1e6)
        out = []
        for p in self._guard(handle).get("processes") or []:
            sm, mem = int(p.get("sm_util", 0)), int(p.get("mem_util", 0))
            if (sm or mem) and now_us > last_seen:
                s = pynvml.c_nvmlProcessUtilizationSample_t()
                s.pid, s.timeStamp, s.smUtil, s.memUtil = int(p["pid"]), now_us, sm, mem
                out.append(s)
        if not out:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return out

    # -- events ----------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> EventSet:
        self._system("driver_version", "")
        es = EventSet()
        self._event_sets.append(es)
        return es

    def nvmlDeviceRegisterEvents(self, handle: Handle, event_types: int, event_set: EventSet) -> None:
        self._guard(handle)
        if event_types & pynvml.nvmlEventTypeXidCriticalError:
            event_set.devices.add(handle.index)

    def nvmlEventSetWait_v2(self, event_set: EventSet, timeout_ms: int) -> EventData:
        """The pending XID of a registered device, once; else NVMLError_Timeout."""
        self._system("driver_version", "")
        for index in sorted(event_set.devices):
            st = self._state[index]
            if st.xid_pending:
                st.xid_pending = False
                code = int(((self.device_config(index).get("failure") or {}).get("xid") or {}).get("code", 0))
                return EventData(self._handles[index], pynvml.nvmlEventTypeXidCriticalError, code,
                                  NOT_AVAILABLE_UINT, NOT_AVAILABLE_UINT)
        raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set: EventSet) -> None:
        if event_set in self._event_sets:
            self._event_sets.remove(event_set)

"""`profagent doctor` rows for NVML: driver, versions, devices, MIG, per-process utilisation."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pynvml

from profagent.config import Config
from profagent.doctor.check import FAIL, OK, WARN, Check
from profagent.errors import SourceUnavailable, UserError
from profagent.sources.gpu.device import PROCESS_LISTS, DeviceHandle, identify, list_processes
from profagent.sources.gpu.nvml import (
    DeviceLost,
    Nvml,
    cuda_version_text,
    open_backend,
    parse_backend,
    text,
)
from profagent.system.procfs import read_nspid

AREA = "gpu"


def check_nvml(config: Config, nvml: Nvml | None = None, proc_root: str | Path = "/proc") -> Iterator[Check]:
    """Rows for the configured GPU backend; never raises."""
    try:
        spec = parse_backend(config.gpu.backend)
    except UserError as exc:
        yield Check(AREA, "backend", FAIL, exc.problem, exc.fix or "")
        return
    if spec.kind == "off":
        yield Check(AREA, "backend", WARN, "gpu.backend = off: GPU metrics disabled", "use --gpu-backend nvml on GPU nodes")
        return
    nvml = nvml or open_backend(spec)
    yield Check(AREA, "backend", WARN if nvml.simulated else OK, spec.label,
                "simulated GPUs, not this machine's hardware" if nvml.simulated else "")
    try:
        nvml.open()
    except SourceUnavailable as exc:
        problem, _, fix = str(exc).partition("; ")
        yield Check(AREA, "NVML library", WARN, problem, fix)
        return
    try:
        yield from _rows(nvml, Path(proc_root))
    finally:
        nvml.close()


def _rows(nvml: Nvml, proc_root: Path) -> Iterator[Check]:
    r = nvml.read
    driver = text(r("system", "driver", "nvmlSystemGetDriverVersion") or "?")
    version = text(r("system", "nvml", "nvmlSystemGetNVMLVersion") or "?")
    cuda = cuda_version_text(r("system", "cuda", "nvmlSystemGetCudaDriverVersion")) or "?"
    yield Check(AREA, "driver", OK, f"driver {driver}, NVML {version}, CUDA {cuda}")
    try:
        count = nvml.call("nvmlDeviceGetCount")
    except (pynvml.NVMLError, SourceUnavailable) as exc:
        yield Check(AREA, "devices", FAIL, f"cannot count GPUs ({exc})", "check `nvidia-smi`")
        return
    if count == 0:
        yield Check(AREA, "devices", WARN, "driver loaded but no GPU visible", "check `nvidia-smi` and CUDA_VISIBLE_DEVICES / container GPU flags")
        return
    yield Check(AREA, "devices", OK, f"{count} GPU(s)")
    listed: set[int] = set()
    for index in range(count):
        dev = DeviceHandle(index)
        try:
            identify(nvml, dev)
        except DeviceLost as exc:
            yield Check(AREA, f"GPU {index}", FAIL, f"does not answer ({exc})", "check `nvidia-smi` and the kernel log for XID errors")
            continue
        except (pynvml.NVMLError, SourceUnavailable) as exc:
            yield Check(AREA, f"GPU {index}", FAIL, str(exc), "check `nvidia-smi`")
            continue
        mig = {"enabled": f"MIG enabled, {len(dev.mig_handles)} MIG device(s)", "disabled": "MIG disabled", "": "MIG not supported"}[dev.mig_mode]
        yield Check(AREA, f"GPU {index}", OK, f"{dev.name} ({dev.pci_bus_id}), {mig}")
        yield _process_util_row(nvml, dev)
        if dev.mig_mode == "enabled":
            yield _mig_attribution_row(nvml, dev)
        listed.update(list_processes(nvml, dev) or {})
    yield _namespace_row(listed, proc_root)


def _namespace_row(pids: set[int], proc_root: Path) -> Check:
    """NVML reports host PIDs: can this agent see them (host PID namespace)?"""
    name = "GPU process PIDs"
    if not pids:
        return Check(AREA, name, OK, "no process on the GPUs right now (nothing to match)")
    hidden = sorted(pid for pid in pids if not (proc_root / str(pid)).exists())
    if hidden and len(read_nspid(proc_root, os.getpid())) > 1:  # the agent in a nested PID namespace
        return Check(AREA, name, WARN, f"{len(hidden)} of {len(pids)} GPU processes are not visible here (PID namespace)",
                     "run the agent with --pid=host (Kubernetes: hostPID: true) for per-rank GPU metrics")
    if hidden:  # in the host's namespace an invisible PID has simply exited
        return Check(AREA, name, OK, f"{len(pids) - len(hidden)} GPU processes visible ({len(hidden)} just exited)")
    return Check(AREA, name, OK, f"all {len(pids)} GPU processes visible")


def _mig_attribution_row(nvml: Nvml, dev: DeviceHandle) -> Check:
    """Under MIG: what per-process attribution works for this user, and what needs root."""
    name = f"GPU {dev.index} MIG per-process"
    root = os.geteuid() == 0
    try:
        nvml.call("nvmlDeviceGetComputeRunningProcesses", dev.handle)
        parent = "the parent GPU's process list answers" + (" (running as root)" if root else "")
    except pynvml.NVMLError_NoPermission:
        parent = "the parent GPU's process list needs root (not needed here)"
    except (pynvml.NVMLError, DeviceLost, SourceUnavailable) as exc:
        parent = f"the parent GPU's process list fails ({exc})"
    memory = ("per-rank GPU memory is not available (NVML leaves usedGpuMemory unavailable under MIG); "
              "each MIG instance's memory is reported")
    if not dev.mig_handles:
        return Check(AREA, name, WARN, f"no MIG device handle answers; {parent}",
                     f"run as root for per-process attribution on the parent GPU; {memory}")
    answered = sum(
        1 for gi, ci, _, _, h in dev.mig_handles
        if any(nvml.read(dev.key, f"mig{gi}.{ci}.{field}", function, h, not_found=[]) is not None
               for field, function in PROCESS_LISTS)
    )
    if answered == 0:
        return Check(AREA, name, WARN, f"no MIG device handle lists its processes; {parent}",
                     f"run as root for per-process attribution on the parent GPU; {memory}")
    return Check(AREA, name, OK,
                 f"processes attributed through {answered} of {len(dev.mig_handles)} MIG device handles (no root needed); {parent}",
                 f"{memory}; SM utilisation per rank is not available under MIG")


def _process_util_row(nvml: Nvml, dev: DeviceHandle) -> Check:
    name = f"GPU {dev.index} per-process utilisation"
    try:
        nvml.call("nvmlDeviceGetProcessUtilization", dev.handle, 0)
    except pynvml.NVMLError_NotFound:
        return Check(AREA, name, OK, "supported (no samples right now)")
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        if dev.mig_mode == "enabled":
            return Check(AREA, name, WARN, "not available under MIG", "SM and memory utilisation per rank are not reported under MIG")
        return Check(AREA, name, WARN, "not supported by this GPU or driver", "per-rank GPU memory is still reported; SM utilisation per rank is not")
    except pynvml.NVMLError as exc:
        if exc.value == pynvml.NVML_SUCCESS:  # some libraries answer "no samples" this way
            return Check(AREA, name, OK, "supported (no samples right now)")
        return Check(AREA, name, WARN, f"failed ({exc})", "check `nvidia-smi pmon`")
    except (DeviceLost, SourceUnavailable) as exc:
        return Check(AREA, name, WARN, f"failed ({exc})", "check `nvidia-smi pmon`")
    return Check(AREA, name, OK, "supported")

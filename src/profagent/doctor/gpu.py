"""`profagent doctor` rows for NVML: driver, versions, devices, MIG, per-process utilisation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pynvml

from profagent.config import Config
from profagent.doctor.check import FAIL, OK, WARN, Check
from profagent.errors import SourceUnavailable, UserError
from profagent.sources.gpu.device import DeviceHandle, identify
from profagent.sources.gpu.nvml import (
    DeviceLost,
    Nvml,
    cuda_version_text,
    open_backend,
    parse_backend,
    text,
)

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
        for function in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            listed.update(p.pid for p in nvml.read(dev.key, function, function, dev.handle, not_found=[]) or [])
    yield _namespace_row(listed, proc_root)


def _namespace_row(pids: set[int], proc_root: Path) -> Check:
    """NVML reports host PIDs: can this agent see them (host PID namespace)?"""
    name = "GPU process PIDs"
    if not pids:
        return Check(AREA, name, OK, "no process on the GPUs right now (nothing to match)")
    hidden = sorted(pid for pid in pids if not (proc_root / str(pid)).exists())
    if hidden:
        return Check(AREA, name, WARN, f"{len(hidden)} of {len(pids)} GPU processes are not visible here (PID namespace)",
                     "run the agent with --pid=host (Kubernetes: hostPID: true) for per-rank GPU metrics")
    return Check(AREA, name, OK, f"all {len(pids)} GPU processes visible")


def _process_util_row(nvml: Nvml, dev: DeviceHandle) -> Check:
    name = f"GPU {dev.index} per-process utilisation"
    try:
        nvml.call("nvmlDeviceGetProcessUtilization", dev.handle, 0)
    except pynvml.NVMLError_NotFound:
        return Check(AREA, name, OK, "supported (no samples right now)")
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
        why = "not available under MIG" if dev.mig_mode == "enabled" else "not supported by this GPU or driver"
        return Check(AREA, name, WARN, why, "per-rank GPU memory is still reported; SM utilisation per rank is not")
    except (pynvml.NVMLError, DeviceLost, SourceUnavailable) as exc:
        return Check(AREA, name, WARN, f"failed ({exc})", "check `nvidia-smi pmon`")
    return Check(AREA, name, OK, "supported")

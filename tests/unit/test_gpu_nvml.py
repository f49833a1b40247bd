"""The NVML entry point and the simulated backend: error mapping, NotSupported memory,
lifecycle, backend parsing."""

from __future__ import annotations

import pynvml
import pytest

from profagent.errors import SourceUnavailable, UserError
from profagent.sources.gpu.nvml import DeviceLost, Nvml, open_backend, parse_backend, parse_gpus
from profagent.sources.gpu.profiles import A100, H100
from profagent.sources.gpu.simulated import SimulatedNvml


def opened(sim: SimulatedNvml) -> Nvml:
    nvml = Nvml(sim, simulated=True)
    nvml.open()
    return nvml


def test_simulated_raises_the_real_pynvml_errors_with_their_codes() -> None:
    sim = SimulatedNvml(H100, 1)
    with pytest.raises(pynvml.NVMLError_Uninitialized) as exc:
        sim.nvmlDeviceGetCount()
    assert exc.value.value == pynvml.NVML_ERROR_UNINITIALIZED
    sim.nvmlInit()
    h = sim.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported) as exc:
        sim.nvmlDeviceGetFanSpeed(h)  # SXM: no fan
    assert exc.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED
    sim.simulatedLoseGpu(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost) as exc:
        sim.nvmlDeviceGetPowerUsage(h)
    assert exc.value.value == pynvml.NVML_ERROR_GPU_IS_LOST


def test_not_supported_is_absent_and_not_asked_again() -> None:
    sim = SimulatedNvml(H100, 2)
    sim.simulatedSetNotSupported(0, "nvmlDeviceGetPowerUsage")
    nvml = opened(sim)
    h0, h1 = sim.nvmlDeviceGetHandleByIndex(0), sim.nvmlDeviceGetHandleByIndex(1)
    for _ in range(5):
        assert nvml.read("gpu0", "power", "nvmlDeviceGetPowerUsage", h0) is None
        assert nvml.read("gpu1", "power", "nvmlDeviceGetPowerUsage", h1) > 0
    assert sim.calls[("nvmlDeviceGetPowerUsage", 0)] == 1
    assert sim.calls[("nvmlDeviceGetPowerUsage", 1)] == 5
    assert not nvml.supported("gpu0", "power") and nvml.supported("gpu1", "power")


def test_lost_gpu_raises_device_lost_and_is_asked_again() -> None:
    sim = SimulatedNvml(H100, 1)
    nvml = opened(sim)
    h = sim.nvmlDeviceGetHandleByIndex(0)
    sim.simulatedLoseGpu(0)
    for _ in range(2):
        with pytest.raises(DeviceLost):
            nvml.read("gpu0", "power", "nvmlDeviceGetPowerUsage", h)
    assert sim.calls[("nvmlDeviceGetPowerUsage", 0)] == 2  # lost is not "unsupported"


def test_not_found_gives_the_callers_empty_value() -> None:
    sim = SimulatedNvml(H100, 1)
    nvml = opened(sim)
    h = sim.nvmlDeviceGetHandleByIndex(0)
    # no process on the GPU: NVML answers NotFound, which means "no samples", not absent
    assert nvml.read("gpu0", "pu", "nvmlDeviceGetProcessUtilization", h, 0, not_found=[]) == []
    assert nvml.supported("gpu0", "pu")


def test_missing_function_is_absent() -> None:
    class Old:
        def nvmlInit(self) -> None: ...

    nvml = Nvml(Old())
    nvml.open()
    assert nvml.read("gpu0", "x", "nvmlDeviceGetSomethingNew", object()) is None
    assert not nvml.supported("gpu0", "x")


def test_field_values_judged_one_by_one() -> None:
    sim = SimulatedNvml(A100, 1)
    nvml = opened(sim)
    h = sim.nvmlDeviceGetHandleByIndex(0)
    wanted = {"memtemp": (pynvml.NVML_FI_DEV_MEMORY_TEMP, 0), "bogus": (9999, 0)}
    first = nvml.fields("gpu0", h, wanted)
    assert set(first) == {"memtemp"} and first["memtemp"] > 0
    assert not nvml.supported("gpu0", "bogus")
    nvml.fields("gpu0", h, wanted)
    assert sim.calls[("nvmlDeviceGetFieldValues", 0)] == 2


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "no NVIDIA driver found (libnvidia-ml.so.1): GPU metrics off"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "NVIDIA driver not loaded"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "no permission"),
    ],
)
def test_init_failures_are_one_line(code: int, words: str) -> None:
    sim = SimulatedNvml(H100, 1)
    sim.simulatedFailInit(code)
    with pytest.raises(SourceUnavailable) as exc:
        Nvml(sim).open()
    message = str(exc.value)
    assert words in message and "\n" not in message
    # no driver at all: a CPU node, where the GPU source has nothing to do (no alert)
    assert exc.value.reason == ("not_applicable" if code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND else "unavailable")


def test_real_pynvml_without_driver_is_unavailable_in_one_line() -> None:
    """This machine has no libnvidia-ml: the real module must say so in one line."""
    nvml = open_backend(parse_backend("nvml"))
    try:
        nvml.open()
    except SourceUnavailable as exc:
        assert str(exc).startswith("no NVIDIA driver found (libnvidia-ml.so.1): GPU metrics off")
        assert "\n" not in str(exc)
    else:  # pragma: no cover - a machine with a GPU
        nvml.close()
        pytest.skip("an NVIDIA driver is present")


def test_close_shuts_nvml_down_once() -> None:
    sim = SimulatedNvml(H100, 1)
    nvml = opened(sim)
    nvml.open()  # idempotent: one init
    nvml.close()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        sim.nvmlDeviceGetCount()
    nvml.close()  # no second shutdown, no error


def test_parse_backend() -> None:
    assert parse_backend("nvml").kind == "nvml"
    assert parse_backend("OFF").kind == "off"
    spec = parse_backend("simulated:h100x8")
    assert (spec.kind, spec.profile, spec.count) == ("simulated", "h100", 8)
    assert parse_backend("simulated").count == 1
    assert parse_backend("simulated:a100").profile == "a100"
    assert parse_backend("simulated:h100-migx2").profile == "h100-mig"
    assert "simulated" in parse_backend("simulated:h100x2").label
    for bad in ("cuda", "simulated:v100", "simulated:h100x0", "simulated:h100x", "simulated:h100x1000"):
        with pytest.raises(UserError) as exc:
            parse_backend(bad)
        assert "simulated:PROFILExN (PROFILE a100, h100 or h100-mig" in str(exc.value)


def test_parse_gpus() -> None:
    assert parse_gpus("") is None
    assert parse_gpus("0,1") == frozenset({0, 1})
    assert parse_gpus(" 3 ") == frozenset({3})
    for bad in ("a", "0,-1", ","):
        with pytest.raises(UserError):
            parse_gpus(bad)

"""How the gpu source treats NVML's answers, tick by tick and without wall-clock waits: the
SUCCESS-with-no-samples and UNKNOWN-from-one-field cases, field errors counted, idle
processes, XID registration after a lost GPU, PCIe units, MPS clients, and the scripted
backend (mock NVML YAML) the contract suite uses."""

from __future__ import annotations

import os
from pathlib import Path

import pynvml
import pytest
import yaml

from profagent.contracts import ROLE_MAIN, ProcessInfo, ProcessTree
from profagent.errors import UserError
from profagent.sources.gpu.nvml import Nvml, parse_backend
from profagent.sources.gpu.profiles import H100
from profagent.sources.gpu.scripted import ScriptedNvml
from profagent.sources.gpu.simulated import SimulatedNvml
from profagent.sources.gpu.source import GpuSource

PID = os.getpid()
MIB = 1024 * 1024


def tree(pid: int = PID) -> ProcessTree:
    return ProcessTree("job", pid, (ProcessInfo(pid, 1, 0.0, ROLE_MAIN, "0", "0", "1", "python train.py", ""),), alive=True)


def started(lib, errors: list[str] | None = None) -> GpuSource:
    src = GpuSource(Nvml(lib, simulated=True))
    if errors is not None:
        src.record_error = errors.append
    src.start()
    return src


class Scripted:
    """A mock-NVML YAML config in a temporary folder, its overrides, and ScriptedNvml on it."""

    def __init__(self, tmp: Path, monkeypatch, devices: list[dict]) -> None:
        monkeypatch.setenv("MOCK_NVML_OVERRIDES_TTL", "0")  # re-read at every call
        monkeypatch.delenv("MOCK_NVML_OVERRIDES", raising=False)
        self.path = tmp / "config.yaml"
        self.path.write_text(yaml.safe_dump({
            "system": {"driver_version": "550.163.01", "cuda_version_major": 12, "cuda_version_minor": 4},
            "device_defaults": {"name": "NVIDIA H100 80GB HBM3", "memory": {"total_bytes": 80 * 1024 * MIB},
                                "power": {"current_draw_mw": 95000}, "fan": {"count": 0}},
            "devices": [{"index": i, "uuid": f"GPU-{i}", **d} for i, d in enumerate(devices)],
        }))
        self.lib = ScriptedNvml(self.path)

    def override(self, devices: dict | None) -> None:
        overrides = self.path.with_name("overrides.yaml")
        if devices is None:
            overrides.unlink()
        else:
            overrides.write_text(yaml.safe_dump({"version": 1, "devices": devices}))


def test_success_code_means_no_samples_not_a_failure() -> None:
    class SuccessForNoSamples(SimulatedNvml):
        def nvmlDeviceGetProcessUtilization(self, handle, last_seen):  # noqa: ANN001, ANN201
            self._dev(handle, "nvmlDeviceGetProcessUtilization")
            raise pynvml.NVMLError(pynvml.NVML_SUCCESS)

    sim = SuccessForNoSamples(H100, 1)
    errors: list[str] = []
    src = started(sim, errors)
    sim.simulatedSetTargetProcesses([(PID, 0)])
    [usage] = src.collect(tree()).processes
    assert (usage.sm_ratio, usage.memory_ratio) == (0.0, 0.0)  # on the GPU, no sample: idle
    assert errors == []
    src.stop()


def test_unknown_from_one_field_is_a_counted_field_error_not_a_lost_gpu(caplog) -> None:
    class UnknownPower(SimulatedNvml):
        def nvmlDeviceGetPowerUsage(self, handle):  # noqa: ANN001, ANN201
            self._dev(handle, "nvmlDeviceGetPowerUsage")
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    sim = UnknownPower(H100, 1)
    errors: list[str] = []
    src = started(sim, errors)
    with caplog.at_level("INFO"):
        for _ in range(3):
            [dev] = src.collect(tree()).devices
            assert dev.up and "power_usage_watts" not in dev.values and "temperature_celsius" in dev.values
    assert errors == ["nvml_unknown"] * 3  # profagent_collector_errors_total{collector="gpu",reason="nvml_unknown"}
    assert sim.calls[("nvmlDeviceGetPowerUsage", 0)] == 3  # asked again: not remembered as unsupported
    assert len([r for r in caplog.records if "power_usage_watts" in r.getMessage()]) == 1  # logged once
    src.stop()


def test_unknown_from_the_device_level_query_marks_the_gpu_down() -> None:
    class UnknownHandle(SimulatedNvml):
        broken = False

        def nvmlDeviceGetHandleByIndex(self, index):  # noqa: ANN001, ANN201
            if self.broken:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
            return super().nvmlDeviceGetHandleByIndex(index)

    sim = UnknownHandle(H100, 2)
    src = started(sim)
    sim.broken = True
    devices = src.collect(tree()).devices
    assert [d.up for d in devices] == [False, False]
    sim.broken = False
    assert [d.up for d in src.collect(tree()).devices] == [True, True]
    src.stop()


def test_idle_process_drops_its_utilisation_within_two_ticks(tmp_path, monkeypatch) -> None:
    busy = {"pid": PID, "type": "C", "used_memory_mib": 2048, "sm_util": 37, "mem_util": 12}
    node = Scripted(tmp_path, monkeypatch, [{"processes": [busy]}])
    src = started(node.lib)
    ticks = [src.collect(tree()).processes[0]]
    node.override({"0": {"processes": [{**busy, "sm_util": 0, "mem_util": 0}]}})
    ticks += [src.collect(tree()).processes[0] for _ in range(3)]
    assert [(u.sm_ratio, u.memory_ratio) for u in ticks] == [(0.37, 0.12), (0.37, 0.12), (0.0, 0.0), (0.0, 0.0)]
    assert all(u.memory_bytes == 2048 * MIB for u in ticks)  # still holds its memory
    node.override(None)
    assert src.collect(tree()).processes[0].sm_ratio == 0.37  # busy again at once
    src.stop()


def test_lost_gpu_returns_and_its_xid_registration_is_renewed(tmp_path, monkeypatch) -> None:
    node = Scripted(tmp_path, monkeypatch, [{}, {}])
    src = started(node.lib)
    assert [d.up for d in src.collect(tree()).devices] == [True, True]
    node.override({"1": {"failure": {"mode": "lost"}}})
    assert [d.up for d in src.collect(tree()).devices] == [True, False]
    node.override(None)
    assert [d.up for d in src.collect(tree()).devices] == [True, True]
    node.override({"1": {"failure": {"mode": "ecc_uncorrectable", "after_calls": 1, "xid": {"code": 48}}}})
    src.collect(tree())  # trips the failure
    snap = src.collect(tree())
    assert dict(snap.devices[1].xid_errors) == {48: 1} and not snap.devices[0].xid_errors
    assert snap.devices[1].values["ecc_uncorrected_errors"] > 0
    src.stop()


def test_pcie_throughput_is_kb_per_second_on_both_simulations(tmp_path, monkeypatch) -> None:
    node = Scripted(tmp_path, monkeypatch, [{"pcie": {"tx_throughput_kbps": 1234, "rx_throughput_kbps": 5}}])
    src = started(node.lib)
    values = src.collect(tree()).devices[0].values
    assert (values["pcie_tx_bytes_per_second"], values["pcie_rx_bytes_per_second"]) == (1_234_000, 5_000)
    src.stop()
    sim = SimulatedNvml(H100, 2)  # GPU 1 holds no rank: idle, the 120 KB/s floor of the waveform
    src = started(sim)
    values = src.collect(tree()).devices[1].values
    kbps = sim.nvmlDeviceGetPcieThroughput(sim.nvmlDeviceGetHandleByIndex(1), pynvml.NVML_PCIE_UTIL_TX_BYTES)
    assert kbps == 120 and values["pcie_tx_bytes_per_second"] == 120_000
    src.stop()


def test_mps_clients_are_attributed_like_compute_processes() -> None:
    class Mps(SimulatedNvml):
        def nvmlDeviceGetComputeRunningProcesses(self, handle):  # noqa: ANN001, ANN201
            self._dev(handle, "nvmlDeviceGetComputeRunningProcesses")
            return []  # only the MPS server would be here

        def nvmlDeviceGetMPSComputeRunningProcesses(self, handle):  # noqa: ANN001, ANN201
            self._dev(handle, "nvmlDeviceGetMPSComputeRunningProcesses")
            info = pynvml.c_nvmlProcessInfo_t()
            info.pid, info.usedGpuMemory = PID, 3 * 1024 * MIB
            return [pynvml.nvmlStructToFriendlyObject(info)]

    src = started(Mps(H100, 1))
    [usage] = src.collect(tree()).processes
    assert (usage.rank, usage.gpu, usage.memory_bytes, usage.processes) == ("0", 0, 3 * 1024 * MIB, 1)
    src.stop()


def test_scripted_backend_spec_and_bad_file(tmp_path) -> None:
    spec = parse_backend(f"simulated:{tmp_path}/Node.yaml")
    assert (spec.kind, spec.script, spec.label) == ("simulated", f"{tmp_path}/Node.yaml", f"simulated from {tmp_path}/Node.yaml")
    with pytest.raises(UserError, match="cannot read GPU script"):
        ScriptedNvml(tmp_path / "missing.yaml")
    (tmp_path / "empty.yaml").write_text("devices: []\n")
    with pytest.raises(UserError, match="lists no devices"):
        ScriptedNvml(tmp_path / "empty.yaml")

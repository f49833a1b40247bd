"""The GPU source's contract, run on two backends with the same assertions.

- ``mock``: NVIDIA's mock ``libnvidia-ml.so.1`` (../shared/nvml-mock) loaded by the real
  pynvml in the agent's own process (``--gpu-backend nvml``, ``LD_LIBRARY_PATH``,
  ``MOCK_NVML_CONFIG``): the real ctypes calls, structures and return codes.
- ``simulated``: profagent's scripted simulation (``--gpu-backend simulated:FILE.yaml``),
  which reads the same configuration and the same ``overrides.yaml``.

Each test copies NVIDIA's H100 profile into its temporary folder, keeps three GPUs, puts
the real PIDs of a real 2-rank job into the process lists, starts the production agent
with ``profagent attach`` and changes the GPUs at runtime through ``overrides.yaml``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from helpers.agent import free_port, http_get, parse_metrics
from helpers.paths import nvml_mock_dir
from helpers.processes import wait_for

MOCK_DIR = nvml_mock_dir()  # NVML_MOCK_DIR, else shared/nvml-mock (helpers.paths)
PROFILE = MOCK_DIR / "configs" / "mock-nvml-config-h100.yaml"
INTERVAL = 0.5
MIB = 1024 * 1024

pytestmark = [pytest.mark.slow]

# A launcher with two ranks; both hang in the same frame (their stacks never change).
LAUNCHER = """
import os, subprocess, sys
RANK = '''
import time
def hung_in_collective():
    while True:
        time.sleep(3600)
hung_in_collective()
'''
kids = [subprocess.Popen([sys.executable, "-c", RANK],
                         env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"})
        for r in range(2)]
with open(sys.argv[0] + ".pids.tmp", "w") as fh:
    fh.write(" ".join(str(k.pid) for k in kids))
os.rename(sys.argv[0] + ".pids.tmp", sys.argv[0] + ".pids")
for k in kids:
    k.wait()
"""

# What each rank's process does on its GPU (rank r on GPU r); GPU 2 holds no rank.
RANK_GPU = {0: {"used_memory_mib": 2048, "sm_util": 37, "mem_util": 12},
            1: {"used_memory_mib": 4096, "sm_util": 55, "mem_util": 20}}


class GpuNode:
    """A configured GPU node, the 2-rank job on it and the agent watching it."""

    def __init__(self, backend: str, tmp: Path, children, run_agent, stacks: bool = False) -> None:
        self.tmp = tmp
        launcher = children.python(LAUNCHER)
        pids_file = tmp / f"child_{len(children.procs) - 1}.py.pids"
        wait_for(pids_file.exists, 30, what="ranks started")
        self.rank_pids = [int(x) for x in pids_file.read_text().split()]
        folder = tmp / "gpu"
        folder.mkdir()
        self.config_path = folder / "config.yaml"
        self.overrides_path = folder / "overrides.yaml"
        config = yaml.safe_load(PROFILE.read_text())
        config["devices"] = config["devices"][:3]
        for rank, pid in enumerate(self.rank_pids):
            config["devices"][rank]["processes"] = [{"pid": pid, "type": "C", "name": "python", **RANK_GPU[rank]}]
        config["devices"][0]["utilization"] = {"gpu": 63, "memory": 41}
        self.config = config
        self.config_path.write_text(yaml.safe_dump(config))

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {"MOCK_NVML_OVERRIDES_TTL": "200ms", "PROFAGENT_STACKS_ENABLED": "true" if stacks else "false",
               "PROFAGENT_STACKS_WINDOW": "1", "PROFAGENT_STACKS_STALL_SECONDS": "2",
               "PROFAGENT_ONDEMAND_ENABLED": "false"}
        if backend == "mock":
            env |= {"LD_LIBRARY_PATH": f"{MOCK_DIR}:{os.environ.get('LD_LIBRARY_PATH', '')}".rstrip(":"),
                    "MOCK_NVML_CONFIG": str(self.config_path)}
            gpu_backend = "nvml"
        else:
            gpu_backend = f"simulated:{self.config_path}"
        self.agent = run_agent(["attach", "--pid", str(launcher.pid), "--listen", f"127.0.0.1:{self.port}",
                                "--interval", str(INTERVAL), "--gpu-backend", gpu_backend], env=env)
        self.agent.wait_healthy(self.url)

    def device(self, index: int) -> dict:
        merged = dict(self.config["device_defaults"])
        for key, value in self.config["devices"][index].items():
            merged[key] = {**merged[key], **value} if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        return merged

    def metrics(self) -> dict:
        return parse_metrics(http_get(self.url + "/metrics"))

    def override(self, devices: dict | None) -> None:
        """Write (or with None delete) overrides.yaml atomically."""
        if devices is None:
            self.overrides_path.unlink(missing_ok=True)
            return
        tmp = self.overrides_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump({"version": 1, "devices": devices}))
        tmp.replace(self.overrides_path)

    def wait(self, predicate, what: str, timeout: float = 30) -> dict:
        def check() -> dict | None:
            m = self.metrics()
            return m if predicate(m) else None
        return wait_for(check, timeout, what=what)


def values(m: dict, name: str, **want: str) -> list[float]:
    return [v for lab, v in m.get(name, []) if all(lab.get(k) == x for k, x in want.items())]


def one(m: dict, name: str, **want: str) -> float:
    found = values(m, name, **want)
    assert len(found) == 1, (name, want, m.get(name))
    return found[0]


def gpu_tick(m: dict) -> float:
    return one(m, "profagent_collector_last_success_timestamp_seconds", collector="gpu")


@pytest.fixture(params=["simulated", "mock"])
def backend(request) -> str:
    return request.param


def test_device_values_equal_the_profile_and_not_supported_is_absent(backend, tmp_path, children, run_agent) -> None:
    node = GpuNode(backend, tmp_path, children, run_agent)
    m = node.wait(lambda m: len(values(m, "profagent_gpu_up")) == 3, "three GPUs")
    assert one(m, "profagent_collector_up", collector="gpu") == 1
    driver = node.config["system"]["driver_version"]
    for index in range(3):
        dev, gpu = node.device(index), str(index)
        info = [lab for lab, _ in m["profagent_gpu_info"] if lab["gpu"] == gpu]
        assert len(info) == 1
        assert info[0]["uuid"] == dev["uuid"] and info[0]["name"] == dev["name"]
        assert info[0]["driver_version"] == driver and info[0]["cuda_version"] == node.config["system"]["cuda_version"]
        assert info[0]["pci_bus_id"] == "0000" + dev["pci"]["bus_id"]
        assert info[0]["mig_mode"] == "disabled"
        assert one(m, "profagent_gpu_up", gpu=gpu) == 1
        expected = {
            "profagent_gpu_memory_total_bytes": dev["memory"]["total_bytes"],
            "profagent_gpu_memory_reserved_bytes": dev["memory"]["reserved_bytes"],
            "profagent_gpu_memory_free_bytes": dev["memory"]["free_bytes"],
            "profagent_gpu_memory_used_bytes": dev["memory"]["used_bytes"],
            "profagent_gpu_power_usage_watts": dev["power"]["current_draw_mw"] / 1000,
            "profagent_gpu_power_limit_watts": dev["power"]["enforced_limit_mw"] / 1000,
            "profagent_gpu_energy_joules_total": dev["power"]["total_energy_consumption_mj"] / 1000,
            "profagent_gpu_temperature_celsius": dev["thermal"]["temperature_gpu_c"],
            "profagent_gpu_memory_temperature_celsius": dev["thermal"]["temperature_memory_c"],
            "profagent_gpu_performance_state": int(dev["performance_state"].lstrip("P")),
            "profagent_gpu_utilization_ratio": dev["utilization"]["gpu"] / 100,
            "profagent_gpu_memory_utilization_ratio": dev["utilization"]["memory"] / 100,
        }
        for family, value in expected.items():
            assert one(m, family, gpu=gpu) == pytest.approx(value), (backend, family, gpu)
        assert one(m, "profagent_gpu_clock_hertz", gpu=gpu, clock="sm") == dev["clocks"]["sm_current"] * 1e6
        assert one(m, "profagent_gpu_clock_hertz", gpu=gpu, clock="memory") == dev["clocks"]["memory_current"] * 1e6
        volatile = dev["ecc"]["errors"]["volatile"]
        assert one(m, "profagent_gpu_ecc_errors_total", gpu=gpu, type="corrected") == volatile["single_bit"]["total"]
        assert one(m, "profagent_gpu_ecc_errors_total", gpu=gpu, type="uncorrected") == volatile["double_bit"]["total"]
        assert one(m, "profagent_gpu_remapped_rows", gpu=gpu, cause="uncorrectable") == dev["remapped_rows"]["uncorrectable"]
        for pcie in ("tx", "rx"):  # KB/s from NVML, bytes/s here
            kbps = dev["pcie"][f"{pcie}_throughput_kbps"]
            assert one(m, "profagent_gpu_pcie_throughput_bytes_per_second", gpu=gpu, direction=pcie) == kbps * 1000
        reasons = {lab["reason"]: v for lab, v in m["profagent_gpu_clock_event_reason_active"] if lab["gpu"] == gpu}
        assert reasons["gpu_idle"] == (1 if dev["clocks_throttle_reasons"]["gpu_idle"] else 0)
        assert reasons["sw_power_cap"] == (1 if dev["clocks_throttle_reasons"]["sw_power_cap"] else 0)
    # NotSupported on this board (SXM: no fan): absent, never 0.
    assert node.config["device_defaults"]["fan"]["count"] == 0
    assert "profagent_gpu_fan_speed_ratio" not in m
    assert not values(m, "profagent_collector_errors_total", collector="gpu")
    assert node.agent.stop() == 0


def test_per_rank_usage_goes_idle_and_the_hung_rank_is_stalled(backend, tmp_path, children, run_agent) -> None:
    node = GpuNode(backend, tmp_path, children, run_agent, stacks=True)

    def attributed(m: dict) -> bool:
        return len(values(m, "profagent_process_gpu_sm_utilization_ratio", role="main")) == 2

    m = node.wait(attributed, "per-rank GPU metrics of both ranks")
    for rank, usage in RANK_GPU.items():
        labels = {"rank": str(rank), "role": "main", "gpu": str(rank)}
        assert one(m, "profagent_process_gpu_memory_used_bytes", **labels) == usage["used_memory_mib"] * MIB
        assert one(m, "profagent_process_gpu_sm_utilization_ratio", **labels) == pytest.approx(usage["sm_util"] / 100)
        assert one(m, "profagent_process_gpu_memory_utilization_ratio", **labels) == pytest.approx(usage["mem_util"] / 100)
        assert one(m, "profagent_process_gpu_processes", **labels) == 1
    assert {lab["gpu"] for lab, _ in m["profagent_process_gpu_processes"]} == {"0", "1"}
    assert one(m, "profagent_gpu_other_processes", gpu="2") == 0

    # Both ranks' stacks stay unchanged well past stacks.stall_seconds (2 s), but their
    # GPUs work: not stalled. The sample counter proves the stacks source kept looking.
    def sampled_for(seconds: float):
        first = {}

        def check(m: dict) -> bool:
            counts = values(m, "profagent_stack_samples_total", rank="0")
            now = sum(counts)
            if not counts:
                return False
            first.setdefault("t", time.monotonic())
            return time.monotonic() - first["t"] > seconds and now > 0
        return check

    m = node.wait(sampled_for(4.0), "stack windows over more than stall_seconds", timeout=60)
    m = node.wait(lambda m: len(values(m, "profagent_rank_stalled")) == 2, "stall verdicts of both ranks", timeout=30)
    assert one(m, "profagent_rank_stalled", rank="0") == 0
    assert one(m, "profagent_rank_stalled", rank="1") == 0

    # Rank 0 goes idle (no utilisation sample any more) while holding its memory; the
    # memory change marks the first tick that saw it.
    idle = {"0": {"processes": [{"pid": node.rank_pids[0], "type": "C", "name": "python",
                                 "used_memory_mib": 3072, "sm_util": 0, "mem_util": 0}]}}
    node.override(idle)
    m = node.wait(lambda m: values(m, "profagent_process_gpu_memory_used_bytes", rank="0") == [3072 * MIB],
                  "the idle override seen")
    first_tick = gpu_tick(m)
    # Within two ticks the old utilisation is gone: 0 (listed, no sample = idle), not absent.
    m = node.wait(lambda m: gpu_tick(m) >= first_tick + 1.5 * INTERVAL, "two more GPU ticks")
    assert one(m, "profagent_process_gpu_sm_utilization_ratio", rank="0", gpu="0") == 0
    assert one(m, "profagent_process_gpu_memory_utilization_ratio", rank="0", gpu="0") == 0
    assert one(m, "profagent_process_gpu_sm_utilization_ratio", rank="1", gpu="1") == pytest.approx(0.55)

    # Stack unchanged and GPU idle: rank 0 is stalled; rank 1 (GPU busy) is not.
    m = node.wait(lambda m: values(m, "profagent_rank_stalled", rank="0") == [1], "rank 0 reported stalled", timeout=60)
    assert one(m, "profagent_rank_stalled", rank="1") == 0
    assert "rank 0 stalled" in node.agent.output
    assert node.agent.stop() == 0


def test_lost_gpu_is_down_comes_back_and_its_xid_is_counted(backend, tmp_path, children, run_agent) -> None:
    node = GpuNode(backend, tmp_path, children, run_agent)
    node.wait(lambda m: len(values(m, "profagent_gpu_up")) == 3, "three GPUs")

    node.override({"2": {"failure": {"mode": "lost"}}})
    m = node.wait(lambda m: values(m, "profagent_gpu_up", gpu="2") == [0], "GPU 2 down")
    before = gpu_tick(m)
    m = node.wait(lambda m: gpu_tick(m) > before, "another GPU tick")  # the others go on
    assert one(m, "profagent_gpu_up", gpu="2") == 0 and not values(m, "profagent_gpu_power_usage_watts", gpu="2")
    for gpu in ("0", "1"):
        assert one(m, "profagent_gpu_up", gpu=gpu) == 1
        assert one(m, "profagent_gpu_power_usage_watts", gpu=gpu) == node.device(int(gpu))["power"]["current_draw_mw"] / 1000
    assert one(m, "profagent_process_gpu_memory_used_bytes", rank="1", gpu="1") == 4096 * MIB
    assert one(m, "profagent_collector_up", collector="gpu") == 1

    node.override(None)
    m = node.wait(lambda m: values(m, "profagent_gpu_up", gpu="2") == [1], "GPU 2 back")
    assert one(m, "profagent_gpu_temperature_celsius", gpu="2") == node.device(2)["thermal"]["temperature_gpu_c"]
    assert not values(m, "profagent_gpu_xid_errors_total", gpu="2")

    # An uncorrectable ECC error with XID 48 on the GPU that came back: counted, so its
    # XID registration was renewed.
    node.override({"2": {"failure": {"mode": "ecc_uncorrectable", "after_calls": 1, "xid": {"code": 48}}}})
    m = node.wait(lambda m: values(m, "profagent_gpu_xid_errors_total", gpu="2", xid="48") == [1], "XID 48 counted")
    assert one(m, "profagent_gpu_ecc_errors_total", gpu="2", type="uncorrected") > 0
    assert one(m, "profagent_gpu_up", gpu="2") == 1
    assert not values(m, "profagent_gpu_xid_errors_total", gpu="0")
    assert node.agent.stop() == 0


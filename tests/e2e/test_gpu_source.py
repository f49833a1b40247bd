"""The gpu source on the simulated backend: device values, lost GPUs, MIG, XID, per-rank
attribution of real child processes, counters, and the rendered exposition."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pynvml
import pytest
from prometheus_client.exposition import generate_latest

from helpers.agent import parse_metrics
from helpers.processes import wait_for
from helpers.prometheus import promtool_check_metrics
from profagent.contracts import ROLE_LAUNCHER, ROLE_MAIN, GpuSnapshot, ProcessInfo, ProcessTree
from profagent.exporters.exposition import Exposition
from profagent.exporters.families import Families
from profagent.exporters.families.gpu import render
from profagent.sources.gpu.nvml import Nvml
from profagent.sources.gpu.profiles import A100, H100, H100_MIG
from profagent.sources.gpu.simulated import SimulatedNvml
from profagent.sources.gpu.source import GpuSource
from profagent.sources.host import HostSource
from profagent.state import State
from profagent.system.procfs import read_nspid
from profagent.target import PidTarget


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def proc(pid: int, rank: str = "0", role: str = ROLE_MAIN, local_rank: str = "0", job_id: str = "") -> ProcessInfo:
    return ProcessInfo(pid, 1, 0.0, role, rank, local_rank, "1", "python train.py", job_id)


def tree_of(*procs: ProcessInfo) -> ProcessTree:
    return ProcessTree("job1", procs[0].pid, tuple(procs), alive=True)


def source(sim: SimulatedNvml, **kw) -> GpuSource:
    src = GpuSource(Nvml(sim, simulated=True), **kw)
    src.start()
    return src


def exposition(snap: GpuSnapshot) -> dict[str, list[tuple[dict[str, str], float]]]:
    out = Families()
    render(snap, out)

    class One:
        def collect(self):
            return iter(out)

    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    reg.register(One())
    return parse_metrics(generate_latest(reg).decode())


def one(metrics: dict, name: str, **labels: str) -> float:
    found = [v for lab, v in metrics.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(found) == 1, (name, labels, metrics.get(name))
    return found[0]


def test_device_values_and_absent_fields() -> None:
    sim = SimulatedNvml(H100, 2)
    src = source(sim)
    snap = src.collect(tree_of(proc(os.getpid())))
    d0, d1 = snap.devices
    assert d0.up and d1.up and d0.uuid.startswith("GPU-") and d0.name == "NVIDIA H100 80GB HBM3"
    for name in ("utilization_ratio", "memory_used_bytes", "memory_reserved_bytes", "power_usage_watts",
                 "power_limit_watts", "energy_joules", "temperature_celsius", "memory_temperature_celsius",
                 "sm_clock_hertz", "pcie_tx_bytes_per_second", "ecc_corrected_errors", "nvlink_tx_bytes"):
        assert name in d0.values, name
    assert d0.values["power_limit_watts"] == 700.0
    assert 0.0 <= d0.values["utilization_ratio"] <= 1.0
    # SXM: no fan, and Hopper remaps rows instead of retiring pages: absent, never 0
    assert "fan_speed_ratio" not in d0.values and "retired_pages_single_bit" not in d0.values
    assert d0.values["remapped_rows_uncorrectable"] == 0
    m = exposition(snap)
    assert "profagent_gpu_fan_speed_ratio" not in m and "profagent_gpu_retired_pages" not in m
    assert one(m, "profagent_gpu_info", gpu="0", simulated="true", driver_version="550.90.07") == 1
    assert d1.values["utilization_ratio"] == 0.0  # no rank on GPU 1 (single-process job on GPU 0)
    src.stop()


def test_not_supported_field_absent_not_zero_and_asked_once() -> None:
    sim = SimulatedNvml(A100, 2)
    sim.simulatedSetNotSupported(1, "nvmlDeviceGetPowerUsage")
    sim.simulatedSetNotSupported(1, "nvmlDeviceGetTotalEnergyConsumption")
    src = source(sim)
    tree = tree_of(proc(os.getpid()))
    for _ in range(4):
        snap = src.collect(tree)
    m = exposition(snap)
    assert one(m, "profagent_gpu_power_usage_watts", gpu="0") > 0
    assert [lab for lab, _ in m["profagent_gpu_power_usage_watts"] if lab["gpu"] == "1"] == []
    assert [lab for lab, _ in m["profagent_gpu_energy_joules_total"] if lab["gpu"] == "1"] == []
    assert sim.calls[("nvmlDeviceGetPowerUsage", 1)] == 1
    assert sim.calls[("nvmlDeviceGetTotalEnergyConsumption", 1)] == 1
    assert sim.calls[("nvmlDeviceGetPowerUsage", 0)] == 4
    assert sim.calls[("nvmlDeviceGetFanSpeed", 0)] == 1  # the profile's own NotSupported, too
    src.stop()


def test_gpu_lost_mid_run_others_continue() -> None:
    sim = SimulatedNvml(H100, 3)
    src = source(sim)
    tree = tree_of(proc(os.getpid()))
    before = src.collect(tree)
    assert all(d.up for d in before.devices)
    sim.simulatedLoseGpu(1)
    after = src.collect(tree)
    assert [d.up for d in after.devices] == [True, False, True]
    assert after.devices[0].values["power_usage_watts"] > 0 and after.devices[2].values
    m = exposition(after)
    uuid1 = before.devices[1].uuid
    assert one(m, "profagent_gpu_up", gpu="1", uuid=uuid1) == 0
    assert one(m, "profagent_gpu_up", gpu="0") == 1
    assert one(m, "profagent_gpu_info", gpu="1") == 1  # identity stays known
    assert [lab for lab, _ in m["profagent_gpu_power_usage_watts"] if lab["gpu"] == "1"] == []
    src.stop()


def test_gpu_lost_before_start_is_down_not_fatal() -> None:
    sim = SimulatedNvml(H100, 2)
    sim.simulatedLoseGpu(0)
    src = source(sim)
    snap = src.collect(tree_of(proc(os.getpid())))
    assert [d.up for d in snap.devices] == [False, True]
    m = exposition(snap)
    assert one(m, "profagent_gpu_up", gpu="0", uuid="") == 0
    assert one(m, "profagent_gpu_up", gpu="1") == 1
    src.stop()


def test_mig_utilization_absent_and_instances_reported() -> None:
    sim = SimulatedNvml(H100_MIG, 1)
    src = source(sim)
    snap = src.collect(tree_of(proc(os.getpid())))
    d = snap.devices[0]
    assert d.mig_mode == "enabled"
    assert "utilization_ratio" not in d.values  # NotSupported under MIG: absent, not 0
    assert "power_usage_watts" in d.values
    assert [(m.gi, m.name.split()[-1]) for m in d.mig_devices] == [(2, "3g.40gb"), (3, "2g.20gb"), (9, "1g.10gb")]
    assert all(m.uuid.startswith("MIG-") and m.memory_total for m in d.mig_devices)
    # Attributed through the MIG device handles (the parent answers NoPermission to a
    # non-root agent); usedGpuMemory is unavailable under MIG: absent, not 0.
    [p] = snap.processes
    assert (p.mig, p.sm_ratio, p.memory_bytes, p.processes) == ("2", None, None, 1)
    assert sim.calls[("nvmlDeviceGetComputeRunningProcesses", 0)] == 3  # one per MIG device
    m = exposition(snap)
    assert "profagent_gpu_utilization_ratio" not in m
    assert "profagent_process_gpu_sm_utilization_ratio" not in m
    assert "profagent_process_gpu_memory_used_bytes" not in m
    assert one(m, "profagent_process_gpu_processes", rank="0", mig="2") == 1
    assert one(m, "profagent_gpu_info", gpu="0", mig_mode="enabled") == 1
    assert one(m, "profagent_gpu_mig_memory_total_bytes", gpu="0", mig="9") == 9984 * 1024 * 1024
    assert snap.rank_busy("0") is None  # no utilisation under MIG: unknown, not idle
    src.stop()


def test_mig_parent_no_permission_is_retried_not_remembered() -> None:
    """Without MIG device handles the parent is asked; NoPermission is asked again later
    (it depends on who runs the agent, not on the GPU)."""
    sim = SimulatedNvml(H100_MIG, 1)
    sim.simulatedSetNotSupported(0, "nvmlDeviceGetMigDeviceHandleByIndex")
    src = source(sim)
    for _ in range(3):
        snap = src.collect(tree_of(proc(os.getpid())))
        assert snap.processes == () and snap.devices[0].up
    assert src.nvml.supported(snap.devices[0].uuid, "compute_processes")
    assert sim.calls[("nvmlDeviceGetComputeRunningProcesses", 0)] == 3
    src.stop()


def test_attribution_to_real_children_by_rank(children) -> None:
    """Two real rank processes (RANK/LOCAL_RANK in their environment) under a launcher."""
    launcher = children.python(
        f"""
        import os, subprocess, sys, time
        kids = []
        for r in (0, 1):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2")
            kids.append(subprocess.Popen([{sys.executable!r}, "-c", "import time; time.sleep(120)"], env=env))
        time.sleep(120)
        """
    )
    target = PidTarget(launcher.pid)
    tree = wait_for(lambda: (t := target.refresh()) and len(t.mains()) == 2 and t, what="two ranks")
    ranks = {p.rank: p.pid for p in tree.mains()}
    sim = SimulatedNvml(H100, 2)
    src = source(sim)
    snap = wait_for(lambda: (s := src.collect(tree)) and all(p.sm_ratio for p in s.processes) and s,
                    timeout=10, what="process utilisation samples")
    by_rank = {p.rank: p for p in snap.processes}
    assert set(by_rank) == {"0", "1"}
    assert (by_rank["0"].gpu, by_rank["1"].gpu) == (0, 1)  # LOCAL_RANK -> device
    assert all(p.role == ROLE_MAIN and p.memory_bytes > 0 and p.processes == 1 for p in by_rank.values())
    assert not [p for p in snap.processes if p.role == ROLE_LAUNCHER]
    assert snap.rank_busy("0") is True and snap.rank_busy("7") is None
    m = exposition(snap)
    assert one(m, "profagent_process_gpu_memory_used_bytes", rank="1", role="main", gpu="1", job_id=tree.job_id) > 0
    assert 0 < one(m, "profagent_process_gpu_sm_utilization_ratio", rank="0", gpu="0") <= 1
    assert all(d.other_processes == 0 for d in snap.devices)
    # PIDs are never labels
    assert all(str(pid) not in lab.values() for pid in ranks.values()
               for lab, _ in m["profagent_process_gpu_memory_used_bytes"])
    src.stop()


def test_watch_mode_keys_processes_by_their_job(tmp_path: Path) -> None:
    """One tree, two jobs (profagent watch): rank 0 of each is its own series."""
    sim = SimulatedNvml(H100, 2)
    src = source(sim, proc_root=tmp_path)
    tree = ProcessTree("", 100, (proc(100, job_id="a"), proc(200, job_id="b", local_rank="1")), alive=True)
    snap = src.collect(tree)
    assert [(p.job_id, p.rank, p.gpu) for p in snap.processes] == [("a", "0", 0), ("b", "0", 1)]
    m = exposition(snap)
    assert one(m, "profagent_process_gpu_memory_used_bytes", job_id="a", rank="0") > 0
    assert one(m, "profagent_process_gpu_memory_used_bytes", job_id="b", rank="0") > 0
    assert snap.rank_busy("0", job_id="b") is True
    src.stop()


def test_process_utilization_keeps_last_seen_timestamp() -> None:
    sim = SimulatedNvml(H100, 1)
    src = source(sim)
    tree = tree_of(proc(os.getpid()))
    seen = []
    for _ in range(3):
        src.collect(tree)
        seen.append(src._last_seen.get(0, 0))
        time.sleep(0.002)
    assert seen[0] > 0 and seen == sorted(seen) and len(set(seen)) == 3
    src.stop()


def test_rank_busy_from_process_or_device_utilization() -> None:
    from types import MappingProxyType

    from profagent.contracts import GpuDevice, ProcessGpuUsage

    def dev(index: int, util: float | None, up: bool = True) -> GpuDevice:
        values = {} if util is None else {"utilization_ratio": util}
        return GpuDevice(index, f"GPU-{index}", "x", "", "disabled", up, values=MappingProxyType(values))

    def usage(rank: str, gpu: int, sm: float | None, job: str = "j") -> ProcessGpuUsage:
        return ProcessGpuUsage(job, rank, "main", gpu, f"GPU-{gpu}", "", 1, 1 << 30, sm, None)

    snap = GpuSnapshot("j", True, "", "", "", (dev(0, 0.0), dev(1, 0.9), dev(2, None), dev(3, 0.9, up=False)),
                       (usage("0", 0, None), usage("1", 1, None), usage("2", 2, None), usage("3", 0, 0.5),
                        usage("4", 3, None), usage("5", 1, 0.0), usage("0", 1, None, job="other")))
    assert snap.rank_busy("0", job_id="j") is False  # its GPU is idle
    assert snap.rank_busy("0", job_id="other") is True
    assert snap.rank_busy("0") is True  # any job
    assert snap.rank_busy("1") is True
    assert snap.rank_busy("2") is None  # utilisation unknown
    assert snap.rank_busy("3") is True  # per-process SM utilisation wins over the device's
    assert snap.rank_busy("4") is None  # its GPU is lost
    assert snap.rank_busy("5") is False
    assert snap.rank_busy("9") is None  # no GPU attributed


def test_nspid_maps_other_namespace_pids(tmp_path: Path) -> None:
    """NVML reports a PID from another namespace level; NSpid links it to the rank."""
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "status").write_text("Name:\tpython\nNSpid:\t4242\t17\n")
    assert read_nspid(tmp_path, 4242) == (4242, 17)
    assert read_nspid(tmp_path, 999) == (999,)
    sim = SimulatedNvml(H100, 1)
    src = source(sim, proc_root=tmp_path)
    src.nvml.simulated = False  # hand the simulated GPU the inner PID ourselves
    sim.simulatedSetTargetProcesses([(17, 0), (31337, 0)])
    snap = src.collect(tree_of(proc(4242, rank="3")))
    assert [(p.rank, p.processes) for p in snap.processes] == [("3", 1)]
    assert snap.devices[0].other_processes == 1  # 31337: not part of the job
    # for `profagent watch`: our own PID for the matched rank, NVML's for the other
    assert src.gpu_pids() == frozenset({4242, 31337})
    src.stop()


@pytest.mark.parametrize("own_nspid, hinted", [("4242\t7", 1), ("4242", 0)])
def test_invisible_gpu_process_hint_only_from_a_nested_namespace(tmp_path: Path, caplog, own_nspid: str, hinted: int) -> None:
    """In a nested PID namespace an invisible NVML PID may be another namespace's: hint
    once. In the host's namespace it simply does not exist (exited): no hint."""
    (tmp_path / str(os.getpid())).mkdir()
    (tmp_path / str(os.getpid()) / "status").write_text(f"Name:\tprofagent\nNSpid:\t{own_nspid}\n")
    sim = SimulatedNvml(H100, 1)
    src = source(sim, proc_root=tmp_path)  # no NVML PID is visible in this /proc
    src.nvml.simulated = False
    sim.simulatedSetTargetProcesses([(5555, 0)])
    with caplog.at_level("WARNING"):
        for _ in range(3):
            snap = src.collect(tree_of(proc(4242)))
    hints = [r.getMessage() for r in caplog.records if "--pid=host" in r.getMessage()]
    assert len(hints) == hinted and all("hostPID: true" in h for h in hints)
    assert snap.processes == () and snap.devices[0].other_processes == 1
    src.stop()


def test_xid_events_counted() -> None:
    sim = SimulatedNvml(H100, 2)
    src = source(sim)
    tree = tree_of(proc(os.getpid()))
    src.collect(tree)
    sim.simulatedInjectXid(1, 79)
    sim.simulatedInjectXid(1, 79)
    sim.simulatedInjectXid(0, 31)
    snap = src.collect(tree)
    assert dict(snap.devices[1].xid_errors) == {79: 2}
    assert dict(snap.devices[0].xid_errors) == {31: 1}
    sim.simulatedInjectXid(1, 79)
    m = exposition(src.collect(tree))
    assert one(m, "profagent_gpu_xid_errors_total", gpu="1", xid="79") == 3
    src.stop()


def test_counters_monotonic() -> None:
    clock = FakeClock()
    sim = SimulatedNvml(H100, 2, clock=clock)
    src = source(sim)
    tree = tree_of(proc(os.getpid()))
    names = ("energy_joules", "nvlink_tx_bytes", "nvlink_rx_bytes", "ecc_corrected_errors")
    last: dict[tuple[int, str], float] = {}
    for step in range(60):
        clock.now += 37.0  # across dips, peaks and idle GPUs
        if step == 30:
            sim.simulatedInjectXid(0, 48)
        snap = src.collect(tree)
        for d in snap.devices:
            for n in names:
                v = d.values[n]
                assert v >= last.get((d.index, n), 0.0), (d.index, n, step)
                last[(d.index, n)] = v
    assert last[(0, "energy_joules")] > last[(1, "energy_joules")] * 0.5  # busy GPU 0 used more
    assert last[(0, "nvlink_tx_bytes")] > 0 and last[(1, "nvlink_tx_bytes")] == 0
    assert last[(0, "ecc_corrected_errors")] >= 2
    src.stop()


def test_gpus_filter_and_bad_index() -> None:
    sim = SimulatedNvml(H100, 4)
    src = source(sim, gpus=frozenset({1, 3}))
    snap = src.collect(tree_of(proc(os.getpid())))
    assert [d.index for d in snap.devices] == [1, 3]
    assert sim.calls[("nvmlDeviceGetPowerUsage", 0)] == 0
    src.stop()
    from profagent.errors import SourceUnavailable

    with pytest.raises(SourceUnavailable) as exc:
        source(SimulatedNvml(H100, 2), gpus=frozenset({5}))
    assert "--gpus 5" in str(exc.value) and "\n" not in str(exc.value)


def test_stop_shuts_down_nvml_and_frees_events() -> None:
    sim = SimulatedNvml(H100, 1)
    src = source(sim)
    src.stop()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        sim.nvmlDeviceGetCount()
    src.stop()  # idempotent


def test_build_sources_wiring() -> None:
    from profagent.config import Config
    from profagent.engine.agent import build_sources
    from profagent.errors import UserError

    config = Config()
    config.gpu.backend = "off"
    sources, disabled = build_sources(config)
    assert "gpu" not in [s.name for s in sources] and "gpu" in [d.name for d in disabled]
    config.gpu.backend, config.gpu.gpus, config.gpu.interval = "simulated:a100x2", "1", 0.25
    [gpu] = [s for s in build_sources(config)[0] if s.name == "gpu"]
    assert isinstance(gpu, GpuSource) and gpu.nvml.simulated and gpu.interval == 0.25
    assert "SIMULATED" in gpu.note
    config.gpu.gpus = "x"
    with pytest.raises(UserError):
        build_sources(config)


def test_promtool_clean_with_8_simulated_gpus(children) -> None:
    """The agent's whole exposition (agent, host and gpu families) passes promtool."""
    kid = children.python("import time; time.sleep(60)", env={"RANK": "0", "LOCAL_RANK": "0"})
    target = PidTarget(kid.pid)
    tree = wait_for(lambda: (t := target.refresh()) and t.mains() and t, what="child")
    state = State()
    state.set_tree(tree)
    for name, src in (("gpu", source(SimulatedNvml(H100, 8))), ("host", HostSource())):
        state.register(name)
        src.start()
        src.collect(tree)
        state.publish(name, src.collect(tree), 0.001)
        src.stop()
    state.register("stacks")
    state.set_down("stacks", "off for this test")
    text = Exposition(state.view).render("")[0].decode()
    assert promtool_check_metrics(text) == ""
    m = parse_metrics(text)
    assert len(m["profagent_gpu_up"]) == 8
    assert len(m["profagent_gpu_info"]) == 8
    assert all(lab["simulated"] == "true" for lab, _ in m["profagent_gpu_info"])
    assert one(m, "profagent_process_gpu_memory_used_bytes", rank="0", gpu="0") > 0


def test_doctor_rows_for_simulated_backend(tmp_path: Path) -> None:
    from profagent.config import Config
    from profagent.doctor.gpu import check_nvml

    config = Config()
    config.gpu.backend = "simulated:h100-migx2"
    rows = list(check_nvml(config))
    by_name = {r.name: r for r in rows}
    assert "simulated" in by_name["backend"].detail
    assert by_name["devices"].detail == "2 GPU(s)"
    assert "MIG enabled, 3 MIG device(s)" in by_name["GPU 0"].detail
    assert by_name["GPU 0 per-process utilisation"].status == "warn"
    assert "per-rank GPU memory is still reported" not in by_name["GPU 0 per-process utilisation"].fix
    mig = by_name["GPU 0 MIG per-process"]
    assert mig.status == "ok" and "through 3 of 3 MIG device handles (no root needed)" in mig.detail
    assert "needs root" in mig.detail and "per-rank GPU memory is not available" in mig.fix
    assert by_name["GPU process PIDs"].status == "ok"  # no process on the simulated GPUs

    # A GPU process whose PID this agent cannot see: a PID-namespace hint with the fix,
    # only when the agent runs in a nested PID namespace; otherwise the PID just exited.
    from profagent.sources.gpu.nvml import Nvml

    for nspid, status in (("4242\t7", "warn"), ("4242", "ok")):
        (tmp_path / str(os.getpid())).mkdir(exist_ok=True)
        (tmp_path / str(os.getpid()) / "status").write_text(f"NSpid:\t{nspid}\n")
        sim = SimulatedNvml(H100, 1)
        sim.simulatedSetTargetProcesses([(2**22 + 17, 0)])
        config.gpu.backend = "simulated:h100"
        rows = {r.name: r for r in check_nvml(config, Nvml(sim, simulated=True), proc_root=tmp_path)}
        assert rows["GPU process PIDs"].status == status
        assert ("--pid=host" in rows["GPU process PIDs"].fix) == (status == "warn")
        assert not sim._refcount  # the doctor shut NVML down again

    config.gpu.backend = "nvml"
    rows = list(check_nvml(config))
    assert any(r.name == "NVML library" and "no NVIDIA driver found" in r.detail for r in rows) or any(
        r.name == "driver" for r in rows
    )


@pytest.mark.skipif(sys.platform != "linux", reason="Linux /proc")
def test_own_nspid_readable() -> None:
    assert read_nspid(Path("/proc"), os.getpid())[0] == os.getpid()


def test_simulated_gpus_behave_like_a_healthy_job() -> None:
    """No dip, no power cap, no finding of its own: a newcomer's first findings in
    `make demo` must be the ones it provokes (issue #23). Sampled every 0.25 s for 3 minutes."""
    clock = FakeClock()
    sim = SimulatedNvml(H100, 2, clock=clock)
    sim.simulatedSetTargetProcesses([(1001, 0), (1002, 1)])
    sim.nvmlInit()
    utils, reasons = [], set()
    for _ in range(720):
        clock.now += 0.25
        for i in range(2):
            handle = sim.nvmlDeviceGetHandleByIndex(i)
            utils.append(sim.nvmlDeviceGetUtilizationRates(handle).gpu)
            reasons.add(sim.nvmlDeviceGetCurrentClocksEventReasons(handle))
            assert sim.nvmlDeviceGetPowerUsage(handle) < sim.nvmlDeviceGetEnforcedPowerLimit(handle)
    assert min(utils) >= 84 and max(utils) <= 92, (min(utils), max(utils))
    assert reasons == {pynvml.nvmlClocksEventReasonNone}
    idle = SimulatedNvml(H100, 3, clock=clock)
    idle.simulatedSetTargetProcesses([(1001, 0)])
    idle.nvmlInit()
    assert idle.nvmlDeviceGetUtilizationRates(idle.nvmlDeviceGetHandleByIndex(2)).gpu == 0  # no rank on GPU 2

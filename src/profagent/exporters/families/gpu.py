"""GPU source families (see docs/gpu.md). Absent values are skipped, never rendered as 0."""

from __future__ import annotations

from profagent.contracts import GpuSnapshot
from profagent.exporters.families import Families

DEV = ("gpu", "uuid")
PROC = ("job_id", "rank", "role", "gpu", "uuid", "mig")  # mig: GPU instance id, "" outside MIG
MIG = ("gpu", "uuid", "mig")

# value name -> (family, kind, help, extra label name, extra label value)
DEVICE_VALUES: dict[str, tuple[str, str, str, str, str]] = {
    "utilization_ratio": ("profagent_gpu_utilization_ratio", "gauge", "fraction of the last sample period in which a kernel ran (0..1); absent under MIG", "", ""),
    "memory_utilization_ratio": ("profagent_gpu_memory_utilization_ratio", "gauge", "fraction of the last sample period in which device memory was read or written (0..1)", "", ""),
    "memory_used_bytes": ("profagent_gpu_memory_used_bytes", "gauge", "device memory allocated by processes", "", ""),
    "memory_free_bytes": ("profagent_gpu_memory_free_bytes", "gauge", "device memory free", "", ""),
    "memory_total_bytes": ("profagent_gpu_memory_total_bytes", "gauge", "device memory installed", "", ""),
    "memory_reserved_bytes": ("profagent_gpu_memory_reserved_bytes", "gauge", "device memory reserved by the driver and firmware (NVML v2 memory info)", "", ""),
    "power_usage_watts": ("profagent_gpu_power_usage_watts", "gauge", "power draw of the board", "", ""),
    "power_limit_watts": ("profagent_gpu_power_limit_watts", "gauge", "enforced power limit", "", ""),
    "energy_joules": ("profagent_gpu_energy", "counter", "energy consumed since the driver was loaded", "", ""),
    "temperature_celsius": ("profagent_gpu_temperature_celsius", "gauge", "GPU die temperature", "", ""),
    "memory_temperature_celsius": ("profagent_gpu_memory_temperature_celsius", "gauge", "HBM temperature", "", ""),
    "sm_clock_hertz": ("profagent_gpu_clock_hertz", "gauge", "current clock frequency by clock domain", "clock", "sm"),
    "memory_clock_hertz": ("profagent_gpu_clock_hertz", "gauge", "current clock frequency by clock domain", "clock", "memory"),
    "performance_state": ("profagent_gpu_performance_state", "gauge", "performance state P0..P15 (0 = maximum performance)", "", ""),
    "fan_speed_ratio": ("profagent_gpu_fan_speed_ratio", "gauge", "intended fan speed as a fraction of the maximum; absent on passively cooled boards", "", ""),
    "pcie_tx_bytes_per_second": ("profagent_gpu_pcie_throughput_bytes_per_second", "gauge", "PCIe throughput over the last 20 ms by direction (tx = from the GPU)", "direction", "tx"),
    "pcie_rx_bytes_per_second": ("profagent_gpu_pcie_throughput_bytes_per_second", "gauge", "PCIe throughput over the last 20 ms by direction (tx = from the GPU)", "direction", "rx"),
    "ecc_corrected_errors": ("profagent_gpu_ecc_errors", "counter", "ECC errors since the driver was loaded, by type", "type", "corrected"),
    "ecc_uncorrected_errors": ("profagent_gpu_ecc_errors", "counter", "ECC errors since the driver was loaded, by type", "type", "uncorrected"),
    "retired_pages_single_bit": ("profagent_gpu_retired_pages", "gauge", "device memory pages retired, by cause (pre-Ampere boards)", "cause", "multiple_single_bit_ecc"),
    "retired_pages_double_bit": ("profagent_gpu_retired_pages", "gauge", "device memory pages retired, by cause (pre-Ampere boards)", "cause", "double_bit_ecc"),
    "remapped_rows_correctable": ("profagent_gpu_remapped_rows", "gauge", "memory rows remapped, by the kind of error that caused it", "cause", "correctable"),
    "remapped_rows_uncorrectable": ("profagent_gpu_remapped_rows", "gauge", "memory rows remapped, by the kind of error that caused it", "cause", "uncorrectable"),
    "row_remap_pending": ("profagent_gpu_row_remap_pending", "gauge", "1 if a row remapping waits for a GPU reset", "", ""),
    "row_remap_failed": ("profagent_gpu_row_remap_failed", "gauge", "1 if a row remapping failed", "", ""),
    "nvlink_tx_bytes": ("profagent_gpu_nvlink_data", "counter", "NVLink payload bytes over all links, by direction (tx = sent)", "direction", "tx"),
    "nvlink_rx_bytes": ("profagent_gpu_nvlink_data", "counter", "NVLink payload bytes over all links, by direction (tx = sent)", "direction", "rx"),
}
UNITS = {"profagent_gpu_energy": "joules", "profagent_gpu_nvlink_data": "bytes"}


def render(snap: GpuSnapshot, out: Families) -> None:
    info = out.gauge(
        "profagent_gpu_info", "one series per GPU; value is 1",
        ("gpu", "uuid", "name", "driver_version", "cuda_version", "pci_bus_id", "simulated", "mig_mode"),
    )
    up = out.gauge("profagent_gpu_up", "1 if the GPU answers NVML, 0 if it is lost", DEV)
    reasons = out.gauge(
        "profagent_gpu_clock_event_reason_active",
        "1 if this reason currently holds the clocks below their maximum (throttling), else 0",
        (*DEV, "reason"),
    )
    xid = out.counter("profagent_gpu_xid_errors", "XID errors reported by the driver, by XID code", (*DEV, "xid"))
    others = out.gauge("profagent_gpu_other_processes", "processes on the GPU that are not part of the target job", DEV)
    simulated = "true" if snap.simulated else "false"
    for d in snap.devices:
        labels = [str(d.index), d.uuid]
        info.add_metric([*labels, d.name, snap.driver_version, snap.cuda_version, d.pci_bus_id, simulated, d.mig_mode], 1)
        up.add_metric(labels, 1 if d.up else 0)
        for code, count in sorted(d.xid_errors.items()):
            xid.add_metric([*labels, str(code)], count)
        if not d.up:
            continue
        for name, value in d.values.items():
            spec = DEVICE_VALUES.get(name)
            if spec is None:
                continue
            family, kind, doc, extra, extra_value = spec
            names = (*DEV, extra) if extra else DEV
            unit = UNITS.get(family, "")
            fam = out.counter(family, doc, names, unit=unit) if kind == "counter" else out.gauge(family, doc, names)
            fam.add_metric([*labels, extra_value] if extra else labels, value)
        for reason, active in d.clock_event_reasons.items():
            reasons.add_metric([*labels, reason], 1 if active else 0)
        if d.other_processes is not None:
            others.add_metric(labels, d.other_processes)
        _render_mig(d.index, d.uuid, d.mig_devices, out)
    _render_processes(snap, out)


def _render_mig(index: int, uuid: str, migs: tuple, out: Families) -> None:
    if not migs:
        return
    info = out.gauge(
        "profagent_gpu_mig_info", "one series per MIG device; value is 1",
        (*MIG, "compute_instance", "mig_uuid", "name"),
    )
    used = out.gauge("profagent_gpu_mig_memory_used_bytes", "memory used in the MIG GPU instance", MIG)
    free = out.gauge("profagent_gpu_mig_memory_free_bytes", "memory free in the MIG GPU instance", MIG)
    total = out.gauge("profagent_gpu_mig_memory_total_bytes", "memory of the MIG GPU instance", MIG)
    seen: set[int] = set()
    for m in migs:
        labels = [str(index), uuid, str(m.gi)]
        info.add_metric([*labels, str(m.ci), m.uuid, m.name], 1)
        if m.gi in seen:
            continue  # memory belongs to the GPU instance, shared by its compute instances
        seen.add(m.gi)
        for fam, value in ((used, m.memory_used), (free, m.memory_free), (total, m.memory_total)):
            if value is not None:
                fam.add_metric(labels, value)


def _render_processes(snap: GpuSnapshot, out: Families) -> None:
    memory = out.gauge(
        "profagent_process_gpu_memory_used_bytes",
        "GPU memory used by the group's processes (mig: GPU instance id, empty outside MIG)",
        PROC,
    )
    sm = out.gauge(
        "profagent_process_gpu_sm_utilization_ratio",
        "fraction of time the group's kernels ran on the GPU's SMs (0..1; absent under MIG)", PROC,
    )
    mem = out.gauge(
        "profagent_process_gpu_memory_utilization_ratio",
        "fraction of time the group's processes read or wrote device memory (0..1; absent under MIG)", PROC,
    )
    count = out.gauge("profagent_process_gpu_processes", "processes of the group that hold a context on the GPU", PROC)
    for p in snap.processes:
        labels = [p.job_id, p.rank, p.role, str(p.gpu), p.uuid, p.mig]
        if p.memory_bytes is not None:
            memory.add_metric(labels, p.memory_bytes)
        if p.sm_ratio is not None:
            sm.add_metric(labels, p.sm_ratio)
        if p.memory_ratio is not None:
            mem.add_metric(labels, p.memory_ratio)
        count.add_metric(labels, p.processes)

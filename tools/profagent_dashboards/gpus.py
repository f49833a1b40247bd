"""GPUs: utilisation, memory, power, energy, temperature, clocks, throttling, PCIe, NVLink,
ECC and XID, per device (NVML)."""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard

from profagent_dashboards.common import (
    BY_KEY,
    BYTES,
    BYTES_RATE,
    CELSIUS,
    GPU,
    HERTZ,
    JOULES,
    NONE,
    PERCENT,
    RANK,
    WATTS,
    dashboard,
    q,
    row,
    stat_panel,
    table_panel,
    ts,
    up_mappings,
)

BOARD = BY_KEY["gpus"]
DEV = "{{instance}} gpu {{gpu}}"
PROC = f'{RANK}, gpu=~"$gpu"'


def build() -> Dashboard:
    d = dashboard(BOARD, "Every GPU of the selected nodes, as NVML reports it.")
    d = (
        d.with_row(row("Utilisation and memory"))
        .with_panel(ts(
            "GPU utilisation", PERCENT, [q(f"profagent_gpu_utilization_ratio{{{GPU}}}", DEV)],
            "fraction of the sample period in which a kernel ran", width=8, max_value=1,
        ))
        .with_panel(ts(
            "Memory bandwidth utilisation", PERCENT, [q(f"profagent_gpu_memory_utilization_ratio{{{GPU}}}", DEV)],
            "fraction of the sample period in which device memory was read or written", width=8, max_value=1,
        ))
        .with_panel(ts(
            "SM utilisation per rank", PERCENT,
            [q(f"profagent_process_gpu_sm_utilization_ratio{{{PROC}}}", "rank {{rank}} {{role}} gpu {{gpu}}")],
            "fraction of time each rank's kernels ran on the GPU's SMs", width=8, max_value=1,
        ))
        .with_panel(ts(
            "Device memory", BYTES,
            [q(f"profagent_gpu_memory_used_bytes{{{GPU}}}", DEV + " used"),
             q(f"profagent_gpu_memory_free_bytes{{{GPU}}}", DEV + " free"),
             q(f"profagent_gpu_memory_reserved_bytes{{{GPU}}}", DEV + " reserved"),
             q(f"profagent_gpu_memory_total_bytes{{{GPU}}}", DEV + " total")],
            "used, free, reserved by the driver, and installed device memory", width=8,
        ))
        .with_panel(ts(
            "GPU memory per rank", BYTES,
            [q(f"profagent_process_gpu_memory_used_bytes{{{PROC}}}", "rank {{rank}} {{role}} gpu {{gpu}}")],
            "device memory held by each rank's processes; steady growth is a leak", width=8,
        ))
        .with_panel(ts(
            "Memory bandwidth utilisation per rank", PERCENT,
            [q(f"profagent_process_gpu_memory_utilization_ratio{{{PROC}}}", "rank {{rank}} {{role}} gpu {{gpu}}")],
            "fraction of time each rank's processes read or wrote device memory", width=8, max_value=1,
        ))
        .with_row(row("Power and thermals"))
        .with_panel(ts(
            "Power", WATTS,
            [q(f"profagent_gpu_power_usage_watts{{{GPU}}}", DEV + " draw"),
             q(f"profagent_gpu_power_limit_watts{{{GPU}}}", DEV + " limit")],
            "board power draw and the enforced power limit", width=8,
        ))
        .with_panel(stat_panel(
            "Energy over the time range", JOULES,
            [q(f"increase(profagent_gpu_energy_joules_total{{{GPU}}}[$__range])", DEV, instant=True)],
            "energy each GPU consumed over the dashboard's time range", width=8, height=8,
        ))
        .with_panel(ts(
            "Temperature", CELSIUS,
            [q(f"profagent_gpu_temperature_celsius{{{GPU}}}", DEV + " die"),
             q(f"profagent_gpu_memory_temperature_celsius{{{GPU}}}", DEV + " HBM")],
            "GPU die and memory (HBM) temperature", width=8,
        ))
        .with_row(row("Clocks and throttling"))
        .with_panel(ts(
            "Clocks", HERTZ, [q(f"profagent_gpu_clock_hertz{{{GPU}}}", DEV + " {{clock}}")],
            "current SM and memory clock frequency", width=8,
        ))
        .with_panel(ts(
            "Throttle reasons active", NONE,
            [q(f"profagent_gpu_clock_event_reason_active{{{GPU}}}", DEV + " {{reason}}")],
            "1 while this reason holds the clocks below their maximum (power cap, thermal, sync boost...)",
            width=8, max_value=1,
        ))
        .with_panel(ts(
            "Performance state", NONE, [q(f"profagent_gpu_performance_state{{{GPU}}}", DEV)],
            "P-state: 0 is maximum performance, up to 15", width=8,
        ))
        .with_row(row("Interconnect"))
        .with_panel(ts(
            "PCIe throughput", BYTES_RATE,
            [q(f"profagent_gpu_pcie_throughput_bytes_per_second{{{GPU}}}", DEV + " {{direction}}")],
            "PCIe traffic by direction (tx = from the GPU)", width=12,
        ))
        .with_panel(ts(
            "NVLink throughput", BYTES_RATE,
            [q(f"rate(profagent_gpu_nvlink_data_bytes_total{{{GPU}}}[$__rate_interval])", DEV + " {{direction}}")],
            "NVLink payload over all links by direction (tx = sent)", width=12,
        ))
        .with_row(row("Errors and health"))
        .with_panel(stat_panel(
            "GPU up", NONE, [q(f"profagent_gpu_up{{{GPU}}}", DEV, instant=True)],
            "1 while the GPU answers NVML, 0 once it is lost (fell off the bus, reset required)",
            width=6, height=8, mappings=up_mappings(), thresholds=((None, "red"), (1, "green")),
        ))
        .with_panel(ts(
            "XID errors", NONE,
            [q(f"sum by (instance, gpu, xid) (increase(profagent_gpu_xid_errors_total{{{GPU}}}[$__rate_interval]))",
               DEV + " XID {{xid}}")],
            "XID errors reported by the driver per interval, by code (48: double-bit ECC, 79: fell off the bus...)",
            width=6,
        ))
        .with_panel(ts(
            "ECC errors since driver load", NONE,
            [q(f"profagent_gpu_ecc_errors_total{{{GPU}}}", DEV + " {{type}}")],
            "corrected and uncorrected ECC errors", width=6,
        ))
        .with_panel(ts(
            "Remapped memory rows", NONE,
            [q(f"profagent_gpu_remapped_rows{{{GPU}}}", DEV + " {{cause}}"),
             q(f"profagent_gpu_row_remap_pending{{{GPU}}}", DEV + " pending"),
             q(f"profagent_gpu_row_remap_failed{{{GPU}}}", DEV + " failed")],
            "rows remapped by cause; pending = waits for a GPU reset, failed = the GPU needs service",
            width=6,
        ))
        .with_panel(ts(
            "Processes on each GPU", NONE,
            [q(f"sum by (instance, gpu, rank) (profagent_process_gpu_processes{{{PROC}}})", DEV + " rank {{rank}}"),
             q(f"profagent_gpu_other_processes{{{GPU}}}", DEV + " not in the job")],
            "processes of each rank holding a context on the GPU, and processes that are not part of the job",
            width=8,
        ))
        .with_panel(table_panel(
            "Devices", NONE,
            [q(f"profagent_gpu_info{{{GPU}}}", instant=True, table_format=True)],
            "every GPU with its name, driver and CUDA version, PCI bus id, MIG mode; simulated=true is not real hardware",
            width=16, hide=("Time", "__name__", "job", "Value"),
        ))
    )
    return d

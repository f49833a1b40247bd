"""Static properties of the simulated GPUs: what `nvidia-smi -q` shows for real boards.

Each profile also says which NVML functions the board answers with NotSupported, so the
simulated backend exercises the same "absent, never 0" paths as real hardware (SXM boards
have no fan; Ampere and Hopper remap rows instead of retiring pages; under MIG the
device-level and per-process utilisation are not available).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1024 * 1024


@dataclass(frozen=True)
class MigSlice:
    """One MIG device: a GPU instance (``gi``) with one compute instance (``ci``)."""

    gi: int
    ci: int
    profile: str  # e.g. "3g.40gb"
    memory_total: int


@dataclass(frozen=True)
class Profile:
    key: str
    name: str  # nvmlDeviceGetName
    memory_total: int
    memory_reserved: int  # v2 memory info: reserved by the driver and firmware
    power_limit_mw: int
    power_idle_mw: int
    sm_clock_max_mhz: int
    sm_clock_idle_mhz: int
    memory_clock_mhz: int
    nvlink_bytes_per_second: float  # per direction, all links, at full load
    pcie_bytes_per_second: float  # per direction, at full load
    pci_buses: tuple[int, ...]
    # Functions answering NVMLError_NotSupported on the physical device.
    not_supported: frozenset[str] = frozenset()
    # With MIG enabled: the slices, and what MIG devices and the parent do not support.
    mig: tuple[MigSlice, ...] = ()
    mig_not_supported: frozenset[str] = field(default_factory=frozenset)


_SXM_NOT_SUPPORTED = frozenset(
    {
        "nvmlDeviceGetFanSpeed",  # SXM boards are cooled by the chassis
        "nvmlDeviceGetRetiredPages",  # Ampere and later remap rows instead
    }
)

# 8-GPU HGX boards put the GPUs on these PCI buses.
_HGX_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)

A100 = Profile(
    key="a100",
    name="NVIDIA A100-SXM4-80GB",
    memory_total=81920 * MIB,
    memory_reserved=537 * MIB,
    power_limit_mw=400_000,
    power_idle_mw=62_000,
    sm_clock_max_mhz=1410,
    sm_clock_idle_mhz=210,
    memory_clock_mhz=1593,
    nvlink_bytes_per_second=300e9,
    pcie_bytes_per_second=24e9,
    pci_buses=(0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD),
    not_supported=_SXM_NOT_SUPPORTED,
)

H100 = Profile(
    key="h100",
    name="NVIDIA H100 80GB HBM3",
    memory_total=81559 * MIB,
    memory_reserved=577 * MIB,
    power_limit_mw=700_000,
    power_idle_mw=72_000,
    sm_clock_max_mhz=1980,
    sm_clock_idle_mhz=345,
    memory_clock_mhz=2619,
    nvlink_bytes_per_second=450e9,
    pcie_bytes_per_second=50e9,
    pci_buses=_HGX_BUSES,
    not_supported=_SXM_NOT_SUPPORTED,
)

H100_MIG = Profile(
    key="h100-mig",
    name=H100.name,
    memory_total=H100.memory_total,
    memory_reserved=H100.memory_reserved,
    power_limit_mw=H100.power_limit_mw,
    power_idle_mw=H100.power_idle_mw,
    sm_clock_max_mhz=H100.sm_clock_max_mhz,
    sm_clock_idle_mhz=H100.sm_clock_idle_mhz,
    memory_clock_mhz=H100.memory_clock_mhz,
    nvlink_bytes_per_second=H100.nvlink_bytes_per_second,
    pcie_bytes_per_second=H100.pcie_bytes_per_second,
    pci_buses=_HGX_BUSES,
    not_supported=_SXM_NOT_SUPPORTED,
    mig=(
        MigSlice(gi=2, ci=0, profile="3g.40gb", memory_total=40448 * MIB),
        MigSlice(gi=3, ci=0, profile="2g.20gb", memory_total=20096 * MIB),
        MigSlice(gi=9, ci=0, profile="1g.10gb", memory_total=9984 * MIB),
    ),
    # Under MIG, NVML reports no device-level or per-process utilisation.
    mig_not_supported=frozenset(
        {"nvmlDeviceGetUtilizationRates", "nvmlDeviceGetProcessUtilization"}
    ),
)

PROFILES: dict[str, Profile] = {
    "a100": A100,
    "a100-sxm4-80gb": A100,
    "h100": H100,
    "h100-sxm5-80gb": H100,
    "h100-mig": H100_MIG,
}
DEFAULT_PROFILE = "h100"

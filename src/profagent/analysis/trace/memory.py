"""Peak allocated memory per device from the ``[memory]`` instant events.

With ``profile_memory=True`` every allocation and free is an instant event whose args
carry ``Total Allocated`` (bytes allocated on that device by the caching allocator's
users, after the event), ``Device Type`` (0 = CPU, 1 = CUDA/HIP) and ``Device Id``.
"""

from __future__ import annotations

DEVICE_TYPES = {0: "cpu", 1: "cuda"}


def device_label(device_type: int | None, device_id: int | None) -> str:
    kind = DEVICE_TYPES.get(device_type if device_type is not None else -1, f"type{device_type}")
    if kind == "cpu":
        return "cpu"
    return f"{kind}:{device_id if device_id is not None and device_id >= 0 else 0}"


def peak_allocated(memory: list[tuple[int | None, int | None, int]]) -> dict[str, int]:
    """Device label ("cpu", "cuda:0") -> peak of Total Allocated, bytes. Empty if no events."""
    peaks: dict[str, int] = {}
    for device_type, device_id, allocated in memory:
        label = device_label(device_type, device_id)
        if allocated > peaks.get(label, -1):
            peaks[label] = allocated
    return peaks

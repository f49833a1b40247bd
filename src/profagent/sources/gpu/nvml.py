"""The one entry point into NVML.

Every NVML call in profagent goes through ``Nvml``, which owns the library's lifecycle and
turns NVML's answers into a few outcomes (the comment above ``Nvml``; docs/gpu.md has the
table per call). The library is injected: ``pynvml``, or a simulated one.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pynvml

from profagent.errors import NotApplicable, SourceUnavailable, UserError
from profagent.logs import LogOnce

log = logging.getLogger(__name__)

# No square brackets: the CLI prints errors through rich, which would read them as markup.
BACKENDS_HELP = (
    "nvml, off, simulated, simulated:PROFILE or simulated:PROFILExN (PROFILE a100, h100 or h100-mig; "
    "e.g. simulated:h100x8), or simulated:FILE.yaml (a mock NVML configuration)"
)



def _classes(*names: str) -> tuple[type[Exception], ...]:
    """The pynvml exception classes of these names that this nvidia-ml-py has (older
    releases lack some, e.g. NVMLLibraryMismatchError before 12.550)."""
    return tuple(cls for name in names if isinstance(cls := getattr(pynvml, name, None), type))


_ABSENT_ERRORS = _classes(
    "NVMLError_NotSupported",
    "NVMLError_FunctionNotFound",
    "NVMLError_ArgumentVersionMismatch",  # a versioned struct the driver doesn't know
    "NVMLLibraryMismatchError",  # unversioned wrapper on an older driver
)
_LOST_ERRORS = _classes("NVMLError_GpuIsLost")
# Down only when the device-level query answers them; a single field answering them is a
# field error (some drivers answer UNKNOWN for one counter while the GPU works).
_DEVICE_LEVEL_LOST_ERRORS = _classes("NVMLError_Unknown", "NVMLError_ResetRequired")
_ERROR_NAMES = {
    value: name.removeprefix("NVML_ERROR_").lower()
    for name, value in vars(pynvml).items()
    if name.startswith("NVML_ERROR_") and isinstance(value, int)
}


def error_reason(exc: pynvml.NVMLError) -> str:
    """A short, bounded label for an NVML error: ``nvml_timeout``, ``nvml_unknown``..."""
    return "nvml_" + _ERROR_NAMES.get(getattr(exc, "value", None), "other")


class DeviceLost(Exception):
    """The device stopped answering (GPU is lost, unknown error, reset required)."""


@dataclass(frozen=True)
class BackendSpec:
    kind: str  # "nvml", "off" or "simulated"
    profile: str = ""
    count: int = 0
    script: str = ""  # simulated from a mock NVML YAML configuration

    @property
    def label(self) -> str:
        if self.kind != "simulated":
            return self.kind
        if self.script:
            return f"simulated from {self.script}"
        from profagent.sources.gpu.profiles import PROFILES

        return f"simulated {PROFILES[self.profile].name} x{self.count}"


def parse_backend(text: str) -> BackendSpec:
    """Parse ``gpu.backend``. Raises UserError naming the accepted forms."""
    from profagent.sources.gpu.profiles import DEFAULT_PROFILE, PROFILES

    if re.fullmatch(r"(?i)simulated:.+\.ya?ml", text.strip()):
        return BackendSpec("simulated", script=text.strip().split(":", 1)[1])
    value = text.strip().lower()
    if value in ("nvml", "off"):
        return BackendSpec(value)
    m = re.fullmatch(r"simulated(?::(?P<profile>[a-z0-9-]*?)(?:x(?P<count>\d+))?)?", value)
    if m:
        profile = m.group("profile") or DEFAULT_PROFILE
        count = int(m.group("count") or 1)
        if profile in PROFILES and 1 <= count <= 64:
            return BackendSpec("simulated", profile, count)
    raise UserError(f"invalid GPU backend {text!r}", f"use {BACKENDS_HELP}")


def parse_gpus(text: str) -> frozenset[int] | None:
    """Parse ``gpu.gpus`` ("0,1"); None = every device. Raises UserError."""
    if not text.strip():
        return None
    try:
        indices = frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UserError(f"invalid GPU list {text!r}", "use comma-separated device indices, e.g. --gpus 0,1") from None
    if not indices or min(indices) < 0:
        raise UserError(f"invalid GPU list {text!r}", "use comma-separated device indices, e.g. --gpus 0,1")
    return indices


def open_backend(spec: BackendSpec, clock: Callable[[], float] | None = None) -> Nvml:
    """An (unopened) Nvml on the real library or on a fresh simulated node."""
    if spec.kind == "simulated" and spec.script:
        from profagent.sources.gpu.scripted import ScriptedNvml

        return Nvml(ScriptedNvml(spec.script, **({"clock": clock} if clock else {})), simulated=True)
    if spec.kind == "simulated":
        from profagent.sources.gpu.profiles import PROFILES
        from profagent.sources.gpu.simulated import SimulatedNvml

        sim = SimulatedNvml(PROFILES[spec.profile], spec.count, **({"clock": clock} if clock else {}))
        return Nvml(sim, simulated=True)
    return Nvml(pynvml, simulated=False)


def text(value: Any) -> str:
    """NVML strings arrive as str or, inside structures, as bytes."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _unavailable(exc: Exception) -> SourceUnavailable:
    """The one line for a library or driver that cannot be used."""
    off = "GPU metrics off"
    if isinstance(exc, pynvml.NVMLError_LibraryNotFound):
        return NotApplicable(
            f"no NVIDIA driver found (libnvidia-ml.so.1): {off}; install the NVIDIA driver, "
            "or set --gpu-backend off to silence this", "no_gpu",
        )
    if isinstance(exc, pynvml.NVMLError_DriverNotLoaded):
        return SourceUnavailable(f"NVIDIA driver not loaded (NVML: {exc}): {off}; load it (`nvidia-smi` should work)")
    if isinstance(exc, pynvml.NVMLError_LibRmVersionMismatch):
        return SourceUnavailable(f"NVML and kernel driver versions differ: {off}; reboot or reload the nvidia module")
    if isinstance(exc, pynvml.NVMLError_NoPermission):
        return SourceUnavailable(f"no permission to open the NVIDIA devices: {off}; run as a user that can open /dev/nvidia*")
    if isinstance(exc, pynvml.NVMLError_Uninitialized):
        return SourceUnavailable(f"NVML was shut down: {off}")
    return SourceUnavailable(f"NVML failed ({exc}): {off}; check `nvidia-smi`")


_FATAL_ERRORS: tuple[type[Exception], ...] = (
    pynvml.NVMLError_LibraryNotFound,
    pynvml.NVMLError_DriverNotLoaded,
    pynvml.NVMLError_LibRmVersionMismatch,
    pynvml.NVMLError_Uninitialized,
)


# Every NVML call in profagent goes through ``Nvml``. It owns the library's lifecycle (init
# on ``open``, shutdown on ``close``) and turns NVML's answers into these outcomes
# (docs/gpu.md has the table per call):
#
# - ``read()`` returns ``None`` for a value the device or driver does not have
#   (NotSupported, FunctionNotFound, ArgumentVersionMismatch, a function missing from
#   pynvml). That (device, field) is remembered and never asked again; absent is never 0.
# - NoPermission leaves the value absent for this tick and is asked again later: it depends
#   on who runs the agent (root, MIG), not on the hardware, so it is never remembered.
# - NotFound, and an ``NVMLError`` carrying SUCCESS (what some libraries answer for "no
#   samples"), return the caller's ``not_found`` value (e.g. [] for "no samples").
# - GpuIsLost from any call raises ``DeviceLost``: that device is down, the others go on.
#   Unknown and ResetRequired raise ``DeviceLost`` only from the device-level query
#   (``call(..., device_level=True)``); from a single field they are field errors.
# - Any other error on a field leaves it absent for this tick, is counted by reason
#   (``take_errors``, exported as ``profagent_collector_errors_total{collector="gpu"}``) and
#   logged once.
# - ``SourceUnavailable`` (one line naming problem and fix) when the library or driver is
#   missing, unloaded or mismatched.
#
# The library itself is injected: the real ``pynvml`` module, or a ``SimulatedNvml`` /
# ``ScriptedNvml`` that has the same functions (``--gpu-backend simulated[:...]``).
class Nvml:
    """Lazy init, shutdown on close, per-field reads with remembered NotSupported."""

    def __init__(self, lib: Any, simulated: bool = False) -> None:
        self.lib = lib
        self.simulated = simulated
        self._opened = False
        self._lock = threading.Lock()
        self._unsupported: set[tuple[str, str]] = set()
        self._log_once = LogOnce(log)
        self._errors: Counter[str] = Counter()  # field errors since take_errors()

    # -- lifecycle ------------------------------------------------------------------
    def open(self) -> None:
        """nvmlInit once. Raises SourceUnavailable with one line naming problem and fix."""
        with self._lock:
            if self._opened:
                return
            try:
                self.lib.nvmlInit()
            except pynvml.NVMLError as exc:
                raise _unavailable(exc) from None
            except OSError as exc:  # a broken library file
                raise SourceUnavailable(f"cannot load libnvidia-ml.so.1 ({exc}): GPU metrics off; reinstall the NVIDIA driver") from None
            self._opened = True

    def close(self) -> None:
        """nvmlShutdown if opened; never raises."""
        with self._lock:
            if not self._opened:
                return
            self._opened = False
            try:
                self.lib.nvmlShutdown()
            except pynvml.NVMLError as exc:
                log.debug("nvmlShutdown: %s", exc)

    @property
    def opened(self) -> bool:
        return self._opened

    # -- calls ------------------------------------------------------------------------
    def call(self, function: str, *args: Any, device_level: bool = False) -> Any:
        """Call one NVML function; NVML errors propagate except the fatal ones
        (SourceUnavailable) and the lost-device ones (DeviceLost: GpuIsLost always;
        Unknown and ResetRequired only with ``device_level``)."""
        fn = getattr(self.lib, function, None)
        if fn is None:
            self._once(f"missing:{function}", f"{function} is not in this pynvml (nvidia-ml-py too old?): its values stay absent")
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        try:
            return fn(*args)
        except _FATAL_ERRORS as exc:
            raise _unavailable(exc) from None
        except _LOST_ERRORS as exc:
            raise DeviceLost(str(exc)) from None
        except _DEVICE_LEVEL_LOST_ERRORS as exc:
            if device_level:
                raise DeviceLost(str(exc)) from None
            raise

    def read(self, device: str, field: str, function: str, *args: Any, not_found: Any = None) -> Any:
        """One field of one device (``device`` is its key, e.g. the UUID): the value, or
        None when absent. NotFound (or an error carrying SUCCESS) returns ``not_found``
        (e.g. [] for "no samples")."""
        key = (device, field)
        if key in self._unsupported:
            return None
        try:
            return self.call(function, *args)
        except _ABSENT_ERRORS as exc:
            self._unsupported.add(key)
            log.debug("GPU %s: %s not available (%s); not asked again", device, field, exc)
            return None
        except pynvml.NVMLError_NotFound:
            return not_found
        except pynvml.NVMLError_NoPermission as exc:
            self._once(f"{field}:perm", f"GPU {device}: no permission to read {field} ({exc}); "
                       "left absent and asked again each tick (logged once)")
            return None
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_SUCCESS:
                return not_found
            self.field_error(device, field, exc)
            return None

    def field_error(self, device: str, field: str, exc: pynvml.NVMLError) -> None:
        """Count a failed field read by reason and log it once per (field, reason)."""
        reason = error_reason(exc)
        self._errors[reason] += 1
        self._once(f"{field}:{reason}", f"GPU {device}: reading {field} failed ({exc}); left absent for this tick (logged once)")

    def take_errors(self) -> Counter[str]:
        """Field errors by reason since the last call (the source turns them into
        profagent_collector_errors_total)."""
        with self._lock:
            out, self._errors = self._errors, Counter()
        return out

    def supported(self, device: str, field: str) -> bool:
        return (device, field) not in self._unsupported

    def fields(self, device: str, handle: Any, wanted: dict[str, tuple[int, int]]) -> dict[str, float]:
        """Several nvmlDeviceGetFieldValues fields in one call, each judged on its own
        return code. Absent fields are left out of the result."""
        ask = {name: fid for name, fid in wanted.items() if self.supported(device, name)}
        if not ask:
            return {}
        names = list(ask)
        values = self.read(device, "field_values", "nvmlDeviceGetFieldValues", handle, [ask[n] for n in names])
        if values is None:
            if not self.supported(device, "field_values"):
                self._unsupported.update((device, n) for n in names)
            return {}
        out: dict[str, float] = {}
        for name, v in zip(names, values, strict=False):
            if v.nvmlReturn == pynvml.NVML_SUCCESS:
                out[name] = field_value(v)
            elif v.nvmlReturn in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                self._unsupported.add((device, name))
            elif v.nvmlReturn == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise DeviceLost(f"field {name}: GPU is lost")
            elif v.nvmlReturn != pynvml.NVML_ERROR_NO_PERMISSION:
                self.field_error(device, name, pynvml.NVMLError(v.nvmlReturn))
        return out

    def hint_processes(self, procs: Iterable[tuple[int, int]]) -> None:
        """Simulated backend only: which (pid, local_rank) use the GPUs. A no-op on NVML."""
        if self.simulated:
            self.lib.simulatedSetTargetProcesses(procs)

    def _once(self, key: str, message: str) -> None:
        self._log_once(logging.INFO, key, "%s", message)


# valueType -> the c_nvmlValue_t member holding it (older pynvml lacks some type names).
_VALUE_MEMBERS = {
    getattr(pynvml, name): member
    for name, member in (
        ("NVML_VALUE_TYPE_DOUBLE", "dVal"),
        ("NVML_VALUE_TYPE_UNSIGNED_INT", "uiVal"),
        ("NVML_VALUE_TYPE_UNSIGNED_LONG", "ulVal"),
        ("NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", "ullVal"),
        ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", "sllVal"),
        ("NVML_VALUE_TYPE_SIGNED_INT", "siVal"),
        ("NVML_VALUE_TYPE_UNSIGNED_SHORT", "usVal"),
    )
    if hasattr(pynvml, name)
}


def field_value(v: Any) -> float:
    """The number inside a c_nvmlFieldValue_t, by its valueType."""
    return float(getattr(v.value, _VALUE_MEMBERS.get(v.valueType, "ullVal")))


def cuda_version_text(version: int | None) -> str:
    """12040 -> "12.4"."""
    if not version:
        return ""
    return f"{version // 1000}.{version % 1000 // 10}"


__all__: Sequence[str] = (
    "BackendSpec",
    "DeviceLost",
    "Nvml",
    "error_reason",
    "open_backend",
    "parse_backend",
    "parse_gpus",
)

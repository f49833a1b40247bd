"""GPU findings from the GPU source's snapshot: ``gpu_idle``, ``gpu_throttled``, ``gpu_errors``."""

from __future__ import annotations

from collections.abc import Mapping

from profagent.analysis.findings.inputs import AnalysisInputs, Analyzer
from profagent.config import FindingsConfig
from profagent.contracts import Finding, FindingKind, GpuSnapshot

THERMAL_OR_HW = ("hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")
POWER = ("sw_power_cap",)


def _users(gpu: GpuSnapshot) -> dict[int, list[tuple[str, str]]]:
    """GPU index -> the (job_id, rank) pairs with processes on it."""
    users: dict[int, list[tuple[str, str]]] = {}
    for p in gpu.processes:
        pair = (p.job_id or gpu.job_id, p.rank)
        if pair not in users.setdefault(p.gpu, []):
            users[p.gpu].append(pair)
    return users


def gpu_idle(gpu: GpuSnapshot, cfg: FindingsConfig, cpu_activity: Mapping[tuple[str, str], tuple[str, float]]) -> list[Finding]:
    """A GPU a rank holds is nearly unused. The evaluator requires it for cfg.gpu_idle_seconds.
    ``cpu_activity``: (job, rank) -> (busiest main-thread category, its share)."""
    devices = {d.index: d for d in gpu.devices if d.up}
    out: list[Finding] = []
    for p in gpu.processes:
        if p.role != "main":
            continue
        dev = devices.get(p.gpu)
        util = p.sm_ratio if p.sm_ratio is not None else (dev.values.get("utilization_ratio") if dev else None)
        if util is None or util >= cfg.gpu_idle_ratio:
            continue
        job = p.job_id or gpu.job_id
        cat, share = cpu_activity.get((job, p.rank), ("unknown", 0.0))
        doing = f"its main thread is mostly in {cat} ({share:.0%})" if cat != "unknown" else "no stack samples"
        out.append(Finding(
            "gpu_idle", job, p.rank, "warning",
            f"GPU {p.gpu} of rank {p.rank} is {util:.0%} busy; meanwhile {doing}",
            {"gpu": p.gpu, "uuid": p.uuid, "utilization": round(util, 3), "threshold": cfg.gpu_idle_ratio,
             "cpu_category": cat, "cpu_share": round(share, 3)},
            advice=f"the GPU waits for the host: shorten what the main thread does in {cat} "
                   "(see that category's finding, `profagent top`), or feed the GPU more work per step"
            if cat not in ("unknown", "none") else "see what the rank's host side does (`profagent top`, `profagent stacks`)",
        ))
    return out


def gpu_throttled(gpu: GpuSnapshot) -> list[Finding]:
    """Active power or thermal clock-event reasons, per rank using the GPU (else for the job)."""
    users = _users(gpu)
    out: list[Finding] = []
    for d in gpu.devices:
        if not d.up:
            continue
        hard = [r for r in THERMAL_OR_HW if d.clock_event_reasons.get(r)]
        power = [r for r in POWER if d.clock_event_reasons.get(r)]
        if not hard and not power:
            continue
        reasons = hard + power
        severity = "warning" if hard else "info"
        clock = d.values.get("sm_clock_hertz")
        temp = d.values.get("temperature_celsius")
        extra = ", ".join(x for x in (
            f"SM clock {clock / 1e6:.0f} MHz" if clock else "", f"{temp:.0f} °C" if temp is not None else "") if x)
        for job, rank in users.get(d.index, [(gpu.job_id, None)]):
            out.append(Finding(
                "gpu_throttled", job, rank, severity,
                f"GPU {d.index} clocks are held down by {', '.join(reasons)}{f' ({extra})' if extra else ''}: "
                + ("check cooling and the board's power delivery" if hard else "the board is at its power cap"),
                {"gpu": d.index, "uuid": d.uuid, "reasons": reasons,
                 **{k: d.values[k] for k in ("sm_clock_hertz", "temperature_celsius", "power_usage_watts") if k in d.values}},
                advice=("check the node's cooling and power delivery (`nvidia-smi -q -d PERFORMANCE`)" if hard
                        else "nothing to fix in the job: the board runs at its power cap"),
            ))
    return out


def gpu_errors(gpu: GpuSnapshot, new_errors: Mapping[int, Mapping[str, int]]) -> list[Finding]:
    """XID events and uncorrected ECC errors seen recently. ``new_errors``: GPU index ->
    {"xid 79": n, "ecc_uncorrected": n} counted by the evaluator over its error window."""
    users = _users(gpu)
    uuids = {d.index: d.uuid for d in gpu.devices}
    out: list[Finding] = []
    for index, errors in sorted(new_errors.items()):
        if not errors:
            continue
        what = ", ".join(f"{name} x{n}" for name, n in sorted(errors.items()))
        for job, rank in users.get(index, [(gpu.job_id, None)]):
            out.append(Finding(
                "gpu_errors", job, rank, "critical",
                f"GPU {index} reported {what}: drain the node and check `nvidia-smi -q` / dmesg "
                "(XID 48, 63, 64, 74, 79, 94, 95 usually need a reset)",
                {"gpu": index, "uuid": uuids.get(index, ""), "errors": dict(errors)},
                advice="drain the node and check `nvidia-smi -q` and dmesg; most XIDs need a GPU reset",
            ))
    return out


def analyze_idle(inputs: AnalysisInputs) -> list[Finding]:
    """Candidates: the evaluator reports one once it has lasted gpu_idle_seconds (``HELD``).
    None while a job hangs: its GPUs idle because of the hang, which says more."""
    if inputs.gpu is None or inputs.hung:
        return []
    activity = {(s.job_id, s.rank): s.top() for s in inputs.shares if s.total}
    return gpu_idle(inputs.gpu, inputs.config, activity)


def analyze_throttled(inputs: AnalysisInputs) -> list[Finding]:
    return gpu_throttled(inputs.gpu) if inputs.gpu is not None else []


def analyze_errors(inputs: AnalysisInputs) -> list[Finding]:
    return gpu_errors(inputs.gpu, inputs.gpu_errors) if inputs.gpu is not None else []


# What evaluate.py runs of this module, in order; none of its kinds is held by steady.py.
ANALYZERS: tuple[Analyzer, ...] = (analyze_idle, analyze_throttled, analyze_errors)
WINDOW_HELD: frozenset[FindingKind] = frozenset()

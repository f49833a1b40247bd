"""Two runs side by side, and what changed, per step: "my run got slower, why?".

A side is one or more analysed traces (one job: one or more per rank). Its figures are
pooled over every complete step of every trace: step_mean = total step time / steps;
a category's time per step = its total over all steps / steps (the categories tile each
step, so they add up to step_mean); a kernel's (op's) time per step = the GPU (self CPU)
time of its instances that start inside a step / steps. GPU ratios are step-weighted means.

The diff ranks contributors by |delta| per step: the eight step-breakdown categories
(their deltas add up to ``step_delta``), then kernels and ops (which explain the kernel
and cpu_exec categories in detail; kernels overlap each other, so their deltas need not
add up). Kernels and ops present on one side only are listed as appeared / vanished.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from profagent.analysis.trace.breakdown import CATEGORIES
from profagent.contracts import TraceReport
from profagent.labels import shorten

LISTED = 15  # kernels and ops kept in contributors, appeared and vanished
UNCHANGED = 0.005  # a step-time change below 0.5% is "no change" in the verdict
IDLE_CAUSES = ("host_wait", "kernel_wait", "other")


@dataclass(frozen=True)
class Side:
    """One run's figures, pooled over its traces (seconds per step unless said)."""

    label: str
    traces: int
    ranks: int
    steps: int
    step_mean: float
    categories: dict[str, float]
    gpu_utilization: float | None  # ratios of step time
    gpu_idle: float | None
    gpu_idle_causes: dict[str, float]  # host_wait, kernel_wait, other: seconds per step
    memory_peak: dict[str, int]  # device -> bytes, max over traces
    kernels: dict[str, float]
    ops: dict[str, float]
    warnings: tuple[str, ...] = ()

    @property
    def steps_per_second(self) -> float:
        return 1.0 / self.step_mean if self.step_mean > 0 else 0.0

    def top(self, kind: str, k: int = 10) -> list[tuple[str, float]]:
        values = self.kernels if kind == "kernel" else self.ops
        return sorted(values.items(), key=lambda kv: (-kv[1], kv[0]))[:k]

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label, "traces": self.traces, "ranks": self.ranks, "steps": self.steps,
            "step_mean": self.step_mean, "steps_per_second": self.steps_per_second,
            "categories": self.categories, "gpu_utilization": self.gpu_utilization, "gpu_idle": self.gpu_idle,
            "gpu_idle_causes": self.gpu_idle_causes, "memory_peak": self.memory_peak,
            "top_kernels": [{"name": n, "seconds": s} for n, s in self.top("kernel")],
            "top_ops": [{"name": n, "seconds": s} for n, s in self.top("op")],
            "warnings": list(self.warnings),
        }


def side(label: str, reports: Sequence[tuple[TraceReport, str | None]]) -> Side:
    """Pool analysed traces (each with its rank) into one side. ``reports`` must come from
    ``analyze(..., in_steps=True)`` and have at least one complete step in all."""
    steps = 0
    step_total = 0.0
    categories = dict.fromkeys(CATEGORIES, 0.0)
    kernels: dict[str, float] = {}
    ops: dict[str, float] = {}
    util = idle = 0.0
    gpu_steps = 0
    causes = dict.fromkeys(IDLE_CAUSES, 0.0)
    memory: dict[str, int] = {}
    warnings: list[str] = []
    for r, _ in reports:
        n = len(r.steps)
        if not n:
            continue
        steps += n
        for s in r.steps:
            step_total += s.seconds
            for k, v in s.breakdown.items():
                categories[k] += v
        for name, v in (r.in_steps or {}).get("kernels", {}).items():
            kernels[name] = kernels.get(name, 0.0) + v
        for name, v in (r.in_steps or {}).get("ops", {}).items():
            ops[name] = ops.get(name, 0.0) + v
        if r.gpu is not None:
            g = r.gpu
            gpu_steps += n
            util += g.utilization * n
            idle += g.idle_ratio * n
            window = sum(s.seconds for s in r.steps)
            for cause, ratio in zip(IDLE_CAUSES, (g.host_wait_ratio, g.kernel_wait_ratio, g.idle_other_ratio),
                                    strict=True):
                causes[cause] += ratio * window
        for device, peak in r.memory_peak.items():
            memory[device] = max(memory.get(device, 0), peak)
        if r.steps_inferred:
            warnings.append(f"{r.path}: no ProfilerStep, its whole window counts as one step")
        warnings.extend(f"{r.path}: {w}" for w in r.warnings)
    if not steps:
        raise ValueError(f"{label}: no complete step in its traces")
    per = 1.0 / steps
    ranks = {rank for _, rank in reports}
    return Side(
        label=label, traces=len(reports), ranks=len(ranks), steps=steps, step_mean=step_total * per,
        categories={k: v * per for k, v in categories.items()},
        gpu_utilization=util / gpu_steps if gpu_steps else None,
        gpu_idle=idle / gpu_steps if gpu_steps else None,
        gpu_idle_causes={k: v * per for k, v in causes.items()} if gpu_steps else {},
        memory_peak=memory,
        kernels={k: v * per for k, v in kernels.items()},
        ops={k: v * per for k, v in ops.items()},
        warnings=tuple(warnings),
    )


@dataclass(frozen=True)
class Diff:
    baseline: Side
    current: Side
    step_delta: float  # seconds per step
    contributors: tuple[dict[str, Any], ...]  # {"kind", "name", "delta"}, by |delta|
    appeared: tuple[dict[str, Any], ...]  # {"kind", "name", "seconds"} (current only)
    vanished: tuple[dict[str, Any], ...]  # (baseline only)
    idle_delta: dict[str, float] = field(default_factory=dict)  # idle cause -> seconds per step

    @property
    def step_ratio(self) -> float:
        b = self.baseline.step_mean
        return self.step_delta / b if b > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline.to_dict(), "current": self.current.to_dict(),
            "step_delta": self.step_delta, "step_ratio": self.step_ratio,
            "contributors": list(self.contributors), "appeared": list(self.appeared),
            "vanished": list(self.vanished), "idle_delta": self.idle_delta, "verdict": verdict(self),
        }


def _deltas(kind: str, before: dict[str, float], after: dict[str, float]) -> list[dict[str, Any]]:
    return [{"kind": kind, "name": n, "delta": after.get(n, 0.0) - before.get(n, 0.0)}
            for n in sorted(set(before) | set(after))]


def _by_size(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda row: (-abs(row[key]), row["kind"], row["name"]))


def diff(baseline: Side, current: Side) -> Diff:
    """What changed from ``baseline`` to ``current``, per step."""
    categories = _deltas("category", baseline.categories, current.categories)
    kernels = _by_size(_deltas("kernel", baseline.kernels, current.kernels), "delta")[:LISTED]
    ops = _by_size(_deltas("op", baseline.ops, current.ops), "delta")[:LISTED]
    contributors = tuple(_by_size([r for r in categories + kernels + ops if r["delta"] != 0.0]
                                  + [r for r in categories if r["delta"] == 0.0], "delta"))
    appeared = [{"kind": kind, "name": n, "seconds": after[n]}
                for kind, before, after in (("kernel", baseline.kernels, current.kernels),
                                            ("op", baseline.ops, current.ops))
                for n in after if n not in before]
    vanished = [{"kind": kind, "name": n, "seconds": before[n]}
                for kind, before, after in (("kernel", baseline.kernels, current.kernels),
                                            ("op", baseline.ops, current.ops))
                for n in before if n not in after]
    idle = {}
    if baseline.gpu_idle_causes and current.gpu_idle_causes:
        idle = {k: current.gpu_idle_causes[k] - baseline.gpu_idle_causes[k] for k in IDLE_CAUSES}
    return Diff(baseline, current, current.step_mean - baseline.step_mean, contributors,
                tuple(_by_size(appeared, "seconds")[:LISTED]), tuple(_by_size(vanished, "seconds")[:LISTED]), idle)


_IDLE_WORDS = {"host_wait": "idle waiting on the host", "kernel_wait": "idle with work queued (kernel wait)",
               "other": "idle not explained by a launch"}
_CATEGORY_WORDS = {"kernel": "compute kernels", "memcpy": "memcpy", "memset": "memset",
                   "communication": "communication", "runtime": "CUDA runtime calls", "dataloader": "the DataLoader",
                   "cpu_exec": "CPU ops", "other": "time outside any traced activity"}


def _ms(seconds: float) -> str:
    return f"{abs(seconds) * 1e3:.1f} ms"


def verdict(d: Diff) -> str:
    """One sentence: the step-time change and its three largest causes, in words."""
    head = f"{d.step_delta * 1e3:+.1f} ms per step ({d.step_ratio:+.1%})"
    if abs(d.step_delta) <= UNCHANGED * d.baseline.step_mean:
        return f"no change in step time: {head}"
    sign = 1 if d.step_delta > 0 else -1
    phrases: list[tuple[float, str]] = []
    for row in d.contributors:
        delta = row["delta"]
        if delta * sign <= 0:
            continue
        more = "more" if delta > 0 else "less"
        name = shorten(row["name"])
        if row["kind"] == "kernel":
            phrases.append((abs(delta), f"{_ms(delta)} {more} in kernel {name}"))
        elif row["kind"] == "op":
            phrases.append((abs(delta), f"{_ms(delta)} {more} self CPU time in op {name}"))
        elif row["name"] not in ("kernel", "cpu_exec"):  # those two are told by kernel and op
            phrases.append((abs(delta), f"{_ms(delta)} {more} in {_CATEGORY_WORDS[row['name']]}"))
    for cause, delta in d.idle_delta.items():
        if delta * sign > 0:
            phrases.append((abs(delta), f"{_ms(delta)} {'more' if delta > 0 else 'less'} GPU {_IDLE_WORDS[cause]}"))
    phrases.sort(key=lambda p: -p[0])
    reasons = [text for size, text in phrases[:3] if size >= 0.05 * abs(d.step_delta)]
    return head + (": " + ", ".join(reasons) if reasons else "")

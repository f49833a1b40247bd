"""What a rank's time goes to: ``dataloader_bound``, ``host_sync_bound``,
``optimizer_bound``, ``compile_storm`` and ``straggler``.

Inputs: the main thread's stack samples by category over the last window (deltas of
the stacks source's counters, see history.CountsWindow) and the last trace of each rank
(step time and step breakdown).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from profagent.analysis.findings import Finding
from profagent.config import FindingsConfig


@dataclass(frozen=True)
class RankShares:
    """One rank's main-thread samples by category over the window."""

    job_id: str
    rank: str
    counts: Mapping[str, int]
    observed_seconds: float  # since the rank's stacks were first seen
    functions: Sequence[tuple[str, int]] = ()  # top leaf functions (cumulative)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def share(self, category: str) -> float:
        return self.counts.get(category, 0) / self.total if self.total else 0.0

    def top(self) -> tuple[str, float]:
        """The busiest category and its share."""
        if not self.total:
            return "none", 0.0
        cat = max(self.counts, key=lambda c: (self.counts[c], c))
        return cat, self.share(cat)


_BOUND = {
    "dataloader_bound": ("dataloader", "waits for the DataLoader",
                         "more DataLoader workers, pin_memory, lighter __getitem__ or prefetching"),
    "host_sync_bound": ("host_sync", "waits for the GPU in synchronising calls",
                        "avoid .item(), .cpu(), printing tensors or torch.cuda.synchronize() every step"),
    "optimizer_bound": ("optimizer", "runs the optimizer step",
                        "use a fused/foreach optimizer, or step less often"),
}


def _functions(r: RankShares, n: int = 3) -> list[str]:
    return [f"{fn}: {count}" for fn, count in r.functions if fn != "other"][:n]


def bound(shares: Iterable[RankShares], traces: Iterable[Any], cfg: FindingsConfig) -> list[Finding]:
    """Per rank: a category's share of the main thread (or trace step) above cfg.bound_ratio."""
    out: list[Finding] = []
    seen: set[tuple[str, str, str]] = set()
    for r in shares:
        if r.total < cfg.min_samples:
            continue
        for kind, (category, what, fix) in _BOUND.items():
            share = r.share(category)
            if share > cfg.bound_ratio:
                seen.add((kind, r.job_id, r.rank))
                out.append(Finding(
                    kind, r.job_id, r.rank, "warning",
                    f"rank {r.rank} {what} {share:.0%} of its main thread's time (last {cfg.window_seconds:.0f} s): {fix}",
                    {"share": round(share, 3), "samples": r.total, "category": category,
                     "threshold": cfg.bound_ratio, "top_functions": _functions(r)},
                ))
        compile_share = r.share("compile")
        if compile_share > cfg.compile_ratio and r.observed_seconds > cfg.compile_grace_seconds:
            out.append(Finding(
                "compile_storm", r.job_id, r.rank, "warning",
                f"rank {r.rank} spends {compile_share:.0%} of its time compiling (torch.compile) "
                f"{r.observed_seconds:.0f} s after start: recompilations (TORCH_LOGS=recompiles says why; "
                "dynamic shapes, changing guards)",
                {"share": round(compile_share, 3), "samples": r.total, "threshold": cfg.compile_ratio,
                 "observed_seconds": round(r.observed_seconds)},
            ))
    for rt in traces:
        ratio = rt.report.breakdown.get("dataloader", 0.0)
        key = ("dataloader_bound", rt.job_id, rt.rank)
        if ratio > cfg.bound_ratio and key not in seen:
            out.append(Finding(
                "dataloader_bound", rt.job_id, rt.rank, "warning",
                f"rank {rt.rank}'s last trace spends {ratio:.0%} of the step in the DataLoader: "
                + _BOUND["dataloader_bound"][2],
                {"trace_share": round(ratio, 3), "trace": rt.report.path, "threshold": cfg.bound_ratio},
            ))
    return out


def _median_others(values: Mapping[str, float], rank: str) -> float:
    return statistics.median(v for r, v in values.items() if r != rank)


def straggler(shares: Iterable[RankShares], traces: Iterable[Any], cfg: FindingsConfig,
              hung_jobs: frozenset[str] = frozenset()) -> list[Finding]:
    """A rank clearly slower than the job's other ranks (a hung job is a ``hang``, not this)."""
    out: list[Finding] = []
    found: set[tuple[str, str]] = set()
    steps: dict[str, dict[str, float]] = {}
    for rt in traces:
        # A trace without steps (no ProfilerStep, no optimizer step) spans its whole window:
        # a window is not a step time (a 1 s on-demand trace is not a 1 s step).
        if rt.report.step_mean and not rt.report.steps_inferred:
            steps.setdefault(rt.job_id, {})[rt.rank] = rt.report.step_mean
    for job, by_rank in steps.items():
        if len(by_rank) < 2 or job in hung_jobs:
            continue
        for rank, step in by_rank.items():
            median = _median_others(by_rank, rank)
            if median > 0 and step > cfg.straggler_ratio * median:
                found.add((job, rank))
                out.append(Finding(
                    "straggler", job, rank, "warning",
                    f"rank {rank} is the straggler: its traced step takes {step * 1e3:.0f} ms, "
                    f"{step / median:.1f}x the other ranks' median ({median * 1e3:.0f} ms)",
                    {"step_seconds": step, "others_median_seconds": median, "steps": dict(by_rank),
                     "threshold_ratio": cfg.straggler_ratio},
                ))
    collective: dict[str, dict[str, RankShares]] = {}
    for r in shares:
        if r.total >= cfg.min_samples:
            collective.setdefault(r.job_id, {})[r.rank] = r
    for job, by_rank in collective.items():
        if len(by_rank) < 2 or job in hung_jobs:
            continue
        in_coll = {rank: r.share("collective") for rank, r in by_rank.items()}
        for rank, share in in_coll.items():
            median = _median_others(in_coll, rank)
            if median - share > cfg.straggler_share and (job, rank) not in found:
                cat, cat_share = by_rank[rank].top()
                out.append(Finding(
                    "straggler", job, rank, "warning",
                    f"rank {rank} is the straggler: the others spend {median:.0%} of their time waiting "
                    f"in collectives, it spends {share:.0%}; its main thread is mostly in {cat} ({cat_share:.0%})",
                    {"collective_share": round(share, 3), "others_median_collective_share": round(median, 3),
                     "shares": {k: round(v, 3) for k, v in in_coll.items()}, "busiest_category": cat,
                     "top_functions": _functions(by_rank[rank]), "threshold": cfg.straggler_share},
                ))
    return out

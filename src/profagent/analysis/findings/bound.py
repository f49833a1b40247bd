"""What a rank's time goes to: ``dataloader_bound``, ``host_sync_bound``,
``optimizer_bound``, ``compile_storm`` and ``straggler``.

Inputs: the main thread's stack samples by category over the last window (deltas of
the stacks source's counters, see history.CountsWindow) and the last trace of each rank
(step time and step breakdown).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from profagent.analysis.findings.hang import held_up_ranks
from profagent.analysis.findings.inputs import AnalysisInputs, Analyzer, RankShares
from profagent.analysis.findings.steps import STRAGGLER_ADVICE, probed_jobs
from profagent.analysis.straggler import low_waiters
from profagent.analysis.straggler import median as median_of
from profagent.config import FindingsConfig
from profagent.contracts import Finding, FindingKind, RankTrace

_BOUND: dict[FindingKind, tuple[str, str, str]] = {
    "dataloader_bound": ("dataloader", "waits for the DataLoader",
                         "more DataLoader workers, pin_memory, lighter __getitem__ or prefetching"),
    "host_sync_bound": ("host_sync", "waits for the GPU in synchronising calls",
                        "avoid .item(), .cpu(), printing tensors or torch.cuda.synchronize() every step"),
    "optimizer_bound": ("optimizer", "runs the optimizer step",
                        "use a fused/foreach optimizer, or step less often"),
}


def _functions(r: RankShares, n: int = 3) -> list[str]:
    return [f"{fn}: {count}" for fn, count in r.functions if fn != "other"][:n]


def bound(shares: Iterable[RankShares], traces: Iterable[RankTrace], cfg: FindingsConfig,
          held_up: set[tuple[str, str]] | frozenset[tuple[str, str]] = frozenset()) -> list[Finding]:
    """Per rank: a category's share of the main thread (or trace step) above cfg.bound_ratio.
    ``held_up``: (job_id, rank) of ranks stalled or waiting on a DataLoader worker that stands
    still; no ``dataloader_bound`` for them (more workers do not help a hung one)."""
    out: list[Finding] = []
    seen: set[tuple[str, str, str]] = set()
    for r in shares:
        if r.total < cfg.min_samples:
            continue
        for kind, (category, what, fix) in _BOUND.items():
            share = r.share(category)
            if kind == "dataloader_bound" and (r.job_id, r.rank) in held_up:
                seen.add((kind, r.job_id, r.rank))
                continue
            if share > cfg.bound_ratio:
                seen.add((kind, r.job_id, r.rank))
                out.append(Finding(
                    kind, r.job_id, r.rank, "warning",
                    f"rank {r.rank} {what} {share:.0%} of its main thread's time (last {cfg.window_seconds:.0f} s): {fix}",
                    {"share": round(share, 3), "samples": r.total, "category": category,
                     "threshold": cfg.bound_ratio, "top_functions": _functions(r)},
                    advice=fix,
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
                advice="run with TORCH_LOGS=recompiles to see which guard fails; mark dynamic dimensions "
                       "(torch._dynamo.mark_dynamic) or compile with dynamic=True",
            ))
    for rt in traces:
        ratio = rt.report.breakdown.get("dataloader", 0.0)
        key = ("dataloader_bound", rt.job_id, rt.rank)
        if ratio > cfg.bound_ratio and key not in seen and (rt.job_id, rt.rank) not in held_up:
            out.append(Finding(
                "dataloader_bound", rt.job_id, rt.rank, "warning",
                f"rank {rt.rank}'s last trace spends {ratio:.0%} of the step in the DataLoader: "
                + _BOUND["dataloader_bound"][2],
                {"trace_share": round(ratio, 3), "trace": rt.report.path, "threshold": cfg.bound_ratio},
                advice=_BOUND["dataloader_bound"][2],
            ))
    return out


def _median_others(values: Mapping[str, float], rank: str) -> float:
    return median_of([v for r, v in values.items() if r != rank])


def warmed_up(r: RankShares, cfg: FindingsConfig) -> bool:
    """A full window of steady, judged stacks: past import and start-up compilation, with
    enough samples, and a native window has said what this rank's waits look like."""
    return (r.judged >= cfg.min_samples and r.judged_seconds >= cfg.window_seconds
            and r.share("compile") <= cfg.compile_ratio)


# The shared straggler rule (analysis/straggler.py) with the live finding's bounds: a share
# more than ``findings.straggler_share`` (absolute) below the others' median, and at most
# half of it (noise under load moves both shares).
_SHORTFALL = 0.5


def _low_waiter(values: Mapping[str, float], threshold: float) -> list[tuple[str, float, float]]:
    """(rank, its share, the others' median) for each rank the straggler rule names."""
    return [(w.rank, w.wait, w.others_median)
            for w in low_waiters(values, threshold, _SHORTFALL, gap_strict=True)]


# The other ranks of the node must wait for a CPU at least this share of the straggler's own
# wait: a rank doing more work than the others waits for a CPU more on any busy node.
CONTENTION_OTHERS = 0.5


def node_contended(queued: Mapping[str, float], rank: str, contention_share: float) -> bool:
    """Whether the node's CPUs, not the rank's own extra work, explain its wait for a CPU:
    it waited ``contention_share`` of the window or more, and the median of the node's other
    ranks waited that much too and at least ``CONTENTION_OTHERS`` of its own wait."""
    mine = queued.get(rank, 0.0)
    others = [q for r, q in queued.items() if r != rank]
    if mine < contention_share or not others:
        return False
    middle = median_of(others)
    return middle >= contention_share and middle >= CONTENTION_OTHERS * mine


def straggler(shares: Iterable[RankShares], traces: Iterable[RankTrace], cfg: FindingsConfig,
              quiet_jobs: frozenset[str] | set[str] = frozenset()) -> list[Finding]:
    """The rank the others wait for: its share of time waiting in collectives (stacks,
    native frames included) or in communication (traces) is far below the others' while
    theirs is high. In a synchronous job every rank's step takes as long as the slowest,
    so step time alone names no one; it still names a rank whose traced step is longer,
    when the job's traces show a collective (ranks that never communicate wait for no one).
    ``quiet_jobs``: jobs with a hang or a suspected one (a stalled rank waits least of all).
    """
    out: list[Finding] = []
    found: set[tuple[str, str]] = set()

    def low_waiters(values: Mapping[str, Mapping[str, float]], describe: Any) -> None:
        for job, by_rank in values.items():
            for rank, share, median in _low_waiter(by_rank, cfg.straggler_share):
                if (job, rank) not in found:
                    found.add((job, rank))
                    summary, evidence = describe(job, rank, share, median, by_rank)
                    out.append(Finding("straggler", job, rank, "warning", summary,
                                       {**evidence, "threshold": cfg.straggler_share}, advice=STRAGGLER_ADVICE))

    by_job: dict[str, list[RankShares]] = {}
    for r in shares:
        by_job.setdefault(r.job_id, []).append(r)
    # every rank of the job must be past its warm-up: a rank still importing waits least
    judged = {job: {r.rank: r for r in ranks} for job, ranks in by_job.items()
              if len(ranks) > 1 and job not in quiet_jobs and all(warmed_up(r, cfg) for r in ranks)}

    def from_stacks(job: str, rank: str, share: float, median: float, in_coll: Mapping[str, float]):
        cat, cat_share = judged[job][rank].top()
        summary = (f"rank {rank} is the straggler: the others spend {median:.0%} of their time waiting "
                   f"in collectives, it spends {share:.0%}; its main thread is mostly in {cat} ({cat_share:.0%})")
        queued = {r: round(q, 3) for r, x in judged[job].items() if (q := x.run_queue_share) is not None}
        contended = node_contended(queued, rank, cfg.contention_share)
        if contended:
            summary += (f", and waits for a CPU {queued[rank]:.0%} of the time: the node's CPUs are contended, "
                        "which slows ranks unevenly; the cause may be the node, not the rank")
        return (summary,
                {"signal": "stacks", "collective_share": round(share, 3),
                 "others_median_collective_share": round(median, 3),
                 "shares": {k: round(v, 3) for k, v in in_coll.items()}, "busiest_category": cat,
                 "top_functions": _functions(judged[job][rank]),
                 "run_queue_shares": queued, "cpu_contended": contended})

    def from_traces(job: str, rank: str, share: float, median: float, by_rank: Mapping[str, float]):
        return (f"rank {rank} is the straggler: in the last traces the others spend {median:.0%} of the step "
                f"in communication, it spends {share:.0%}",
                {"signal": "traces", "communication_share": round(share, 3),
                 "others_median_communication_share": round(median, 3),
                 "communication_shares": {k: round(v, 3) for k, v in by_rank.items()}})

    low_waiters({job: {r: x.wait_share for r, x in ranks.items()} for job, ranks in judged.items()}, from_stacks)
    comm: dict[str, dict[str, float]] = {}
    steps: dict[str, dict[str, float]] = {}
    for rt in traces:
        if "communication" in rt.report.breakdown:
            comm.setdefault(rt.job_id, {})[rt.rank] = rt.report.breakdown["communication"]
        # A trace without steps (no ProfilerStep, no optimizer step) spans its whole window:
        # a window is not a step time (a 1 s on-demand trace is not a 1 s step).
        if rt.report.step_mean and not rt.report.steps_inferred:
            steps.setdefault(rt.job_id, {})[rt.rank] = rt.report.step_mean
    low_waiters({job: v for job, v in comm.items() if len(v) > 1 and job not in quiet_jobs}, from_traces)
    for job, by_rank in steps.items():
        # Ranks that never communicate wait for no one (as `analyze` says): their steps
        # differ with their own load and instrumentation, e.g. one rank profiling itself
        # with profile_memory on a busy node (the demo under stress-ng).
        if len(by_rank) < 2 or job in quiet_jobs or not any(comm.get(job, {}).values()):
            continue
        for rank, step in by_rank.items():
            median = _median_others(by_rank, rank)
            if median > 0 and step > cfg.straggler_ratio * median and (job, rank) not in found:
                out.append(Finding(
                    "straggler", job, rank, "warning",
                    f"rank {rank} is the straggler: its traced step takes {step * 1e3:.0f} ms, "
                    f"{step / median:.1f}x the other ranks' median ({median * 1e3:.0f} ms)",
                    {"signal": "trace_steps", "step_seconds": step, "others_median_seconds": median,
                     "steps": dict(by_rank), "threshold_ratio": cfg.straggler_ratio},
                    advice=STRAGGLER_ADVICE,
                ))
    return out


def analyze_bound(inputs: AnalysisInputs) -> list[Finding]:
    """No ``dataloader_bound`` for a rank stalled or waiting on a DataLoader worker that stands still."""
    return bound(inputs.shares, inputs.rank_traces, inputs.config, held_up_ranks(inputs.stalls))


def analyze_straggler(inputs: AnalysisInputs) -> list[Finding]:
    """No straggler in a job that hangs or may be hanging: its stalled rank waits least.
    A job whose collectives the kernel probes match gets its straggler from arrivals
    (steps.py) instead: wait shares from sampled stacks name healthy ranks under load."""
    quiet = inputs.hung | inputs.suspected | probed_jobs(inputs)
    return straggler(inputs.shares, inputs.rank_traces, inputs.config, quiet)


# What evaluate.py runs of this module, in order, and its kinds that steady.py holds after
# their evidence was last seen (judged over a window, they sit on their line).
ANALYZERS: tuple[Analyzer, ...] = (analyze_straggler, analyze_bound)
WINDOW_HELD: frozenset[FindingKind] = frozenset({"straggler", "dataloader_bound", "host_sync_bound", "optimizer_bound", "compile_storm"})

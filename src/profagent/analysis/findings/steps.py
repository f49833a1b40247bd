"""Findings from the step timeline (kernel probes): ``straggler`` from collective
arrivals, with the stage that explains it, ``dataloader_bound`` from the exact data-wait
share, and ``stall``, a warning that the job's steps have stopped, long before the
stack-based ``hang``.

Input: the timeline source's snapshot (``RankSteps`` per rank, ``ArrivalStraggler`` per
job) and, for the stall's location, the stacks source's stalls.
"""

from __future__ import annotations

from profagent.analysis.findings.hang import held_up_ranks
from profagent.analysis.findings.inputs import AnalysisInputs, Analyzer
from profagent.analysis.stacks import innermost_python, own_frame
from profagent.analysis.straggler import CAUSE_STAGES, StageCause, stage_cause
from profagent.contracts import Finding, FindingKind, Frame, RankSteps, TimelineSnapshot

DATALOADER_FIX = "more DataLoader workers, pin_memory, lighter __getitem__ or prefetching"
STRAGGLER_ADVICE = ("see what that rank does more than the others (`profagent top`, its busiest functions): "
                    "more data per rank, a slower node or GPU, CPU contention; balance the work or move the rank")


def probed_jobs(inputs: AnalysisInputs) -> frozenset[str]:
    """Jobs whose collectives the probes match across ranks: their straggler comes from
    arrivals, not from stack wait shares."""
    t = inputs.timeline
    if t is None:
        return frozenset()
    return frozenset(s.job_id for s in t.stragglers if s.collectives >= inputs.config.arrival_min_collectives)


def analyze_arrival_straggler(inputs: AnalysisInputs) -> list[Finding]:
    """The rank whose lags, added up over a step, are the most at most of the job's steps,
    by a real share of the step; and which of its stages explains it. Never in a job that
    hangs or may be hanging (a hung rank arrives at nothing)."""
    t, cfg = inputs.timeline, inputs.config
    if t is None:
        return []
    out = []
    quiet = inputs.hung | inputs.suspected | _stopped_jobs(t.ranks, cfg.stall_warning_seconds)
    for s in t.stragglers:
        if s.job_id in quiet or s.collectives < cfg.arrival_min_collectives or s.step_seconds <= 0 \
                or s.span_seconds < cfg.arrival_min_seconds:
            continue
        # what the others wait for it, less what it waits for them (ranks of equal work
        # take turns arriving last: on a loaded node, a small bias times FSDP's many
        # collectives a step adds up), a share of each step
        lag_share = (s.step_lag - s.others_step_lag) / s.step_seconds
        if s.step_last_share < cfg.arrival_last_share or lag_share < cfg.arrival_lag_share:
            continue
        shares = {r.rank: r.stage_shares for r in t.ranks if r.job_id == s.job_id and r.window_steps > 0}
        cause = stage_cause(shares, s.rank)
        summary = (f"rank {s.rank} is the straggler: it lagged the most at {s.step_last_share:.0%} of the job's last "
                   f"{s.steps} steps, up to {s.step_max_lag * 1e3:.1f} ms behind the first rank at the median step; "
                   f"its lags of a step add up to {s.step_lag * 1e3:.1f} ms against {s.others_step_lag * 1e3:.1f} ms "
                   f"for the others ({lag_share:.0%} of a {s.step_seconds * 1e3:.0f} ms step more; {s.collectives} "
                   f"collectives, last at {s.last_share:.0%} of them); the others wait for it")
        evidence: dict[str, object] = {
            "signal": "arrivals", "step_last_share": round(s.step_last_share, 3), "steps": s.steps,
            "last_share": round(s.last_share, 3), "median_lag_seconds": s.median_lag,
            "step_max_lag_seconds": s.step_max_lag,
            "step_lag_seconds": s.step_lag, "others_step_lag_seconds": s.others_step_lag,
            "step_seconds": s.step_seconds, "lag_share": round(lag_share, 3),
            "collectives": s.collectives, "span_seconds": round(s.span_seconds, 1),
            "threshold_last_share": cfg.arrival_last_share, "threshold_lag_share": cfg.arrival_lag_share}
        advice = STRAGGLER_ADVICE
        if cause is not None:
            summary += ". " + _cause_text(cause)
            advice = CAUSE_ADVICE[cause.stage]
            evidence.update({"cause": cause.stage or None,
                             "stage_shares": {st: round(v, 3) for st, v in cause.shares.items()},
                             "others_stage_shares": {st: round(v, 3) for st, v in cause.others.items()}})
        out.append(Finding("straggler", s.job_id, s.rank, "warning", summary, evidence, advice=advice))
    return out


# What a straggler's stage says of its cause, and what to do about it.
_CAUSE_NAMES = {"data_wait": ("data wait", "its DataLoader"), "backward": ("backward", "its backward"),
                "optimizer": ("optimizer step", "its optimizer step"),
                "other": ("forward and host work", "its forward, host code or device")}
CAUSE_ADVICE = {
    "data_wait": f"that rank's DataLoader is slower than the others': {DATALOADER_FIX} (or that node's disk, "
                 "network or CPUs, if it reads from its own)",
    "backward": "that rank's backward takes longer: more work in its batches (longer sequences, uneven batch sizes), "
                "or a slower device; balance the batches (a length-grouped sampler) or move the rank",
    "optimizer": "that rank's optimizer step takes longer: more parameters or optimizer state on it (uneven "
                 "sharding, CPU offload on that rank only), or a slower device",
    "other": "that rank's forward or host code takes longer: more work in its batches, host work on that rank "
             "only (logging, evaluation, .item() syncs), or a slower device the host waits for",
    "": "no stage explains it: the rank is slower all through, with more work than the others (bigger batches, "
        "more layers), a slower device or a busy node (its CPUs, `profagent top`, the node's other processes); "
        "balance the work, move the rank or free its node",
}


def _cause_text(cause: StageCause) -> str:
    if not cause.stage:
        spread = ", ".join(f"{_CAUSE_NAMES[st][0]} {cause.shares[st]:.0%} against {cause.others[st]:.0%}"
                           for st in CAUSE_STAGES)
        return f"No stage explains it ({spread} on the others): more work, a slower device or a busy node"
    name, what = _CAUSE_NAMES[cause.stage]
    return (f"Its {name} is {cause.shares[cause.stage]:.0%} of its step against {cause.others[cause.stage]:.0%} "
            f"on the others: {what}")


def analyze_data_wait(inputs: AnalysisInputs) -> list[Finding]:
    """A rank whose steps spend more than ``bound_ratio`` waiting for the DataLoader."""
    t, cfg = inputs.timeline, inputs.config
    if t is None:
        return []
    out = []
    held_up = held_up_ranks(inputs.stalls)  # a hung DataLoader worker: more workers do not help
    for r in t.ranks:
        share = r.stage_shares.get("data_wait", 0.0)
        if r.window_steps >= cfg.min_steps and share > cfg.bound_ratio and (r.job_id, r.rank) not in held_up:
            out.append(Finding(
                "dataloader_bound", r.job_id, r.rank, "warning",
                f"rank {r.rank} waits for the DataLoader {share:.0%} of each step (last {r.window_steps} steps, "
                f"kernel probes): {DATALOADER_FIX}",
                {"signal": "timeline", "data_wait_share": round(share, 3), "steps": r.window_steps,
                 "step_p50_seconds": r.p50, "threshold": cfg.bound_ratio},
                advice=DATALOADER_FIX))
    return out


PAUSE_SECONDS = 3.0  # a job's probes quiet this long (or PAUSE_FACTOR x its p90 step): a stall may be starting
PAUSE_FACTOR = 3.0


def pausing_jobs(timeline: TimelineSnapshot | None) -> frozenset[str]:
    """Jobs whose every rank has hit no probe for max(PAUSE_SECONDS, PAUSE_FACTOR x its
    p90 step): the stacks source samples them at the full rate, so that a ``stall``
    warning names the line a rank stands on now, not one from a long steady window."""
    if timeline is None:
        return frozenset()
    by_job: dict[str, list[RankSteps]] = {}
    for r in timeline.ranks:
        by_job.setdefault(r.job_id, []).append(r)
    return frozenset(job for job, rs in by_job.items()
                     if all(r.since_step_seconds is not None and r.idle_seconds is not None
                            and r.idle_seconds >= _stall_after(r, PAUSE_SECONDS, PAUSE_FACTOR) for r in rs))


def stepped_within(timeline: TimelineSnapshot | None, job_id: str | None, rank: str, seconds: float) -> bool:
    """Whether the kernel probes saw the rank make an optimizer step in the last ``seconds``
    (of the timeline's latest snapshot). ``job_id`` None or "": any job (attach mode)."""
    if timeline is None:
        return False
    return any(r.rank == rank and (not job_id or r.job_id == job_id) and r.since_step_seconds is not None
               and r.since_step_seconds < seconds for r in timeline.ranks)


def _stall_after(r: RankSteps, floor: float, factor: float) -> float:
    return max(floor, factor * (r.p90 or 0.0))


def _stopped_jobs(ranks: tuple[RankSteps, ...], floor: float) -> frozenset[str]:
    by_job: dict[str, list[RankSteps]] = {}
    for r in ranks:
        by_job.setdefault(r.job_id, []).append(r)
    return frozenset(job for job, rs in by_job.items()
                     if all(r.idle_seconds is not None and r.idle_seconds >= floor for r in rs))


def analyze_stall(inputs: AnalysisInputs) -> list[Finding]:
    """Every rank of a job that stepped has hit no probe at all (no step, no DataLoader
    wait, no backward, no collective: an evaluation loop still iterates its DataLoader)
    for max(``stall_warning_seconds``, ``stall_warning_factor`` x its p90 step): name the rank
    holding the job (of the ranks still in the earliest step, the one that called the fewest
    collectives since its last step began: the others wait in their next collective), what it was doing (its stage), and its line from the stacks. It clears when
    steps resume; the stack-based ``hang`` takes over at ``stacks.stall_seconds``."""
    t, cfg = inputs.timeline, inputs.config
    if t is None:
        return []
    by_job: dict[str, list[RankSteps]] = {}
    for r in t.ranks:
        by_job.setdefault(r.job_id, []).append(r)
    out = []
    for job, ranks in sorted(by_job.items()):
        if job in inputs.hung or not all(r.since_step_seconds is not None and r.idle_seconds is not None for r in ranks):
            continue
        if not all((r.idle_seconds or 0.0) >= _stall_after(r, cfg.stall_warning_seconds, cfg.stall_warning_factor)
                   for r in ranks):
            continue
        # the step first: where a step begins before its forward (Lightning's
        # optimizer.step(closure), a zero_grad boundary) the ranks ahead have begun the next
        # step and called fewer collectives in it; then the collectives within that step
        behind = _behind(ranks)
        fewest = min(r.step_collectives for r in behind)
        holding = [r for r in behind if r.step_collectives == fewest] if len(ranks) > 1 else ranks
        if len(holding) == len(ranks) and len(ranks) > 1:
            holding = []  # every rank called as many: they wait together (elsewhere, or the network)
        idle = {r.rank: r.idle_seconds or 0.0 for r in ranks}
        # only a stack sampled since the rank stopped (a second's slack: the two sources'
        # snapshots are taken apart; a window that began just before is mostly the new stack)
        lines = {s.rank: line for s in inputs.stalls if s.job_id == job and s.rank in idle
                 and s.window_age_seconds <= idle[s.rank] + 1.0 and (line := user_line(s.frames))}
        stopped = min(r.since_step_seconds or 0.0 for r in ranks)  # steps stopped before the last probe hit
        if holding:
            names = ", ".join(f"rank {r.rank} ({_stage(r)}{' at ' + lines[r.rank] if r.rank in lines else ''})"
                              for r in holding)
            summary = (f"the job has made no step for {stopped:.0f} s: {names} holds it up; "
                       "the others wait in their next collective")
        elif len({lines.get(r.rank) for r in ranks}) == 1 and ranks[0].rank in lines:
            # every rank stands on one line of the job's own code: a save every rank makes, say
            summary = (f"the job has made no step for {stopped:.0f} s: every rank seen here stands at "
                       f"{lines[ranks[0].rank]} ({', '.join(f'rank {r.rank} {_stage(r)}' for r in ranks)}): "
                       "a save, a rank on another node, or the network")
        else:
            summary = (f"the job has made no step for {stopped:.0f} s: every rank seen here waits "
                       f"({', '.join(f'rank {r.rank} {_stage(r)}' + (f' at {lines[r.rank]}' if r.rank in lines else '') for r in ranks)}): "
                       "a save, a rank on another node, or the network")
        out.append(Finding(
            "stall", job, holding[0].rank if len(holding) == 1 else None, "warning", summary,
            {"signal": "timeline", "since_step_seconds": {r.rank: round(r.since_step_seconds or 0.0, 1) for r in ranks},
             "stages": {r.rank: r.stage_now or "other" for r in ranks},
             "collectives_in_step": {r.rank: r.step_collectives for r in ranks},
             "holding_ranks": [r.rank for r in holding], "locations": lines,
             "threshold_seconds": cfg.stall_warning_seconds, "threshold_factor": cfg.stall_warning_factor},
            advice=("look at the holding rank's line; for a checkpoint save, nothing (it clears when the steps "
                    "resume) or save asynchronously (torch.distributed.checkpoint.async_save)")
            if holding else ("look at the other nodes' agents, a checkpoint being saved, or the network "
                             "(NCCL_DEBUG=INFO)")))
    return out


def _behind(ranks: list[RankSteps]) -> list[RankSteps]:
    """The ranks still in the job's earliest step: those whose last step began within half a
    step of the earliest last step's start. The ranks of a job begin a step within their skew
    of each other, and a rank a step ahead began its step about a whole step later. Judged by
    the start's time, not by the step counts: those count from when each rank was first seen,
    which differs, and lost probe events make them a floor."""
    steps = [x for r in ranks if (x := r.p50 or (r.step_seconds_sum / r.steps_total if r.steps_total else 0.0)) > 0]
    if not steps:
        return ranks
    earliest = max(r.since_step_seconds or 0.0 for r in ranks)
    return [r for r in ranks if earliest - (r.since_step_seconds or 0.0) < 0.5 * min(steps)]


def user_line(frames: tuple[Frame, ...]) -> str:
    """The innermost frame of the job's own code (not a framework's, torch's or Python's:
    ``analysis/stacks.py`` ``is_user``), else the innermost Python frame, else the
    innermost frame; "" without frames."""
    f = own_frame(frames) or innermost_python(frames) or (frames[-1] if frames else None)
    return str(f) if f is not None else ""


def _stage(r: RankSteps) -> str:
    return {"data_wait": "waiting for data", "backward": "in backward", "optimizer": "in the optimizer"}.get(
        r.stage_now, "in the forward or host code")


# What evaluate.py runs of this module, in order, and its kinds that steady.py holds after
# their evidence was last seen (judged over a window, they sit on their line).
ANALYZERS: tuple[Analyzer, ...] = (analyze_arrival_straggler, analyze_data_wait, analyze_stall)
WINDOW_HELD: frozenset[FindingKind] = frozenset({"straggler", "dataloader_bound"})

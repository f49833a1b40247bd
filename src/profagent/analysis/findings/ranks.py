"""``duplicate_rank``: two processes of one job claim one rank.

A job's processes are one user's (watch mode labels a job with its user, see
target/node.py), but within that user two roots may still name the same job and rank: two
Slurm steps of one job on the node (both SLURM_PROCID=0), a job started twice with one
TORCHELASTIC_RUN_ID. Every per-rank figure of that rank then mixes two processes, so the
finding says so rather than let a stack or a step of one pass for the other's.
"""

from __future__ import annotations

from profagent.analysis.findings.inputs import AnalysisInputs, Analyzer
from profagent.contracts import Finding, FindingKind

MAIN = "main"


def analyze(inputs: AnalysisInputs) -> list[Finding]:
    host = inputs.host
    if host is None:
        return []
    out = []
    for g in host.groups:
        if g.role != MAIN or g.processes < 2 or not g.rank:
            continue
        out.append(Finding(
            "duplicate_rank", g.job_id, g.rank, "warning",
            f"{g.processes} processes claim rank {g.rank} of job {g.job_id}: its figures mix them",
            {"processes": g.processes},
            advice="give each process its own RANK (or job id): two launches of one job, or two Slurm steps "
                   "of one job on this node, share a rank; profagent_target_info lists their PIDs",
        ))
    return out


# What evaluate.py runs of this module, in order; none of its kinds is held by steady.py.
ANALYZERS: tuple[Analyzer, ...] = (analyze,)
WINDOW_HELD: frozenset[FindingKind] = frozenset()

"""Findings: answers computed from the latest state of every source (pure, no I/O).

A finding says what is wrong with a job or one of its ranks, how bad it is, and the
evidence it rests on. The set of kinds is closed and documented in docs/diagnosis.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SEVERITIES = ("info", "warning", "critical")  # in increasing order

KINDS = (
    "hang",
    "straggler",
    "dataloader_bound",
    "host_sync_bound",
    "optimizer_bound",
    "compile_storm",
    "gpu_idle",
    "memory_leak",
    "gpu_throttled",
    "gpu_errors",
)


@dataclass(frozen=True)
class Finding:
    """One active finding. ``rank`` is None for a finding about the whole job.

    ``evidence`` holds JSON-ready numbers and stack lines; ``since`` is the wall-clock
    time (Unix seconds) at which the finding was first seen, kept while it stays active;
    ``advice`` is what to do about it, in a sentence.
    """

    finding: str
    job_id: str
    rank: str | None
    severity: str
    summary: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    since: float = 0.0
    advice: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.finding, self.job_id, self.rank or "")

    def as_dict(self) -> dict[str, Any]:
        return {
            "finding": self.finding, "job_id": self.job_id, "rank": self.rank,
            "severity": self.severity, "summary": self.summary,
            "evidence": dict(self.evidence), "since": self.since, "advice": self.advice,
        }


@dataclass(frozen=True)
class FindingsSnapshot:
    """Every active finding at one tick (the engine publishes it in State as "findings")."""
    findings: tuple[Finding, ...] = ()
    time: float = 0.0  # wall clock of the evaluation
    # (job_id, rank, share): each rank's main-thread share of time waiting in collectives over
    # the window, for ranks past their warm-up (profagent_collective_wait_ratio)
    wait_shares: tuple[tuple[str, str, float], ...] = ()
    evaluations: int = 0  # ticks evaluated since the engine started (proof that it looked)

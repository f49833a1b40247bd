"""What every analyzer reads: ``AnalysisInputs``, one frozen bundle the evaluator prepares
each tick from the latest snapshots and the short histories it keeps. Every analyzer is
``analyze(inputs: AnalysisInputs) -> list[Finding]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from profagent.analysis.findings.history import MemorySeries
from profagent.config import FindingsConfig
from profagent.contracts import (
    Finding,
    GpuSnapshot,
    HostSnapshot,
    RankStall,
    RankTrace,
    StacksSnapshot,
    TimelineSnapshot,
    TracesSnapshot,
)


@dataclass(frozen=True)
class RankShares:
    """One rank's main-thread samples by category over the window."""

    job_id: str
    rank: str
    counts: Mapping[str, int]
    observed_seconds: float  # since the rank's stacks were first seen
    functions: Sequence[tuple[str, int]] = ()  # top leaf functions (cumulative)
    judged: int = 0  # main-thread samples of the window judged for collective waits
    waits: float = 0.0  # how many of them waited in a collective (Python or native frames)
    judged_seconds: float = 0.0  # since the rank's first judged window
    run_queue: float = 0.0  # seconds of the window its main thread waited for a CPU...
    run_queue_over: float = 0.0  # ...out of these (host source: /proc/PID/schedstat)

    @property
    def wait_share(self) -> float:
        return self.waits / self.judged if self.judged else 0.0

    @property
    def run_queue_share(self) -> float | None:
        """Share of the window its main thread was runnable but waited for a CPU."""
        return self.run_queue / self.run_queue_over if self.run_queue_over > 0 else None

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


@dataclass(frozen=True)
class MemoryInput:
    job_id: str
    rank: str
    what: str  # "host memory (RSS) of the main process", "GPU 0 memory"...
    kind: str  # "host" or "gpu"
    series: MemorySeries
    available: float | None  # bytes still available to grow into


@dataclass(frozen=True)
class AnalysisInputs:
    """One tick's evidence. Job ids are filled in (a snapshot's own ``job_id`` where a row
    has none), so analyzers key everything by (job, rank).

    ``hung`` is empty in the first phase (the hang analyzer) and holds the jobs with a hang
    finding this tick in the second phase (every other analyzer): see ``evaluate.py``."""

    config: FindingsConfig
    now: float  # wall clock, seconds
    host: HostSnapshot | None = None
    gpu: GpuSnapshot | None = None
    stacks: StacksSnapshot | None = None
    traces: TracesSnapshot | None = None
    timeline: TimelineSnapshot | None = None
    shares: tuple[RankShares, ...] = ()  # each rank's main-thread samples over the window
    rank_traces: tuple[RankTrace, ...] = ()  # the last trace of each rank
    stalls: tuple[RankStall, ...] = ()  # each rank's main thread: stalled, suspected, where
    memory: tuple[MemoryInput, ...] = ()  # memory histories with what is still available
    gpu_errors: Mapping[int, Mapping[str, int]] = field(default_factory=dict)  # GPU index -> new errors
    was_hung: frozenset[str] = frozenset()  # jobs with a hang finding at the last evaluation
    suspected: frozenset[str] = frozenset()  # jobs with a rank whose stack stands still
    hung: frozenset[str] = frozenset()  # jobs with a hang finding now (second phase only)


# One analyzer: the findings of its kinds from one tick's inputs (pure).
Analyzer = Callable[[AnalysisInputs], list[Finding]]

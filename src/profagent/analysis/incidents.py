"""Incident decisions (pure, no I/O): what triggers a capture, when, and what to delete.

- ``hang_triggers``: one trigger per job with an active ``hang`` finding.
- ``RegressionDetector``: a rank's trace step time above ``factor`` x its own recent
  baseline (median of its last normal traces, or ``traces.baseline``) for ``seconds``;
  its evidence names the top contributors of the diff of the slow trace against the
  baseline (``traces.baseline``, else the rank's first steady traces), as ``profagent diff``.
- ``IncidentGate``: turns the triggers seen at each tick into at most one capture:
  an episode (a trigger kind for a job, active from one tick to the next) fires once,
  only while no capture runs, and at most once per job and kind per ``period``.
- ``to_remove``: which stored incidents go so that count and bytes stay bounded.
- ``self_profiling``: the ranks that profile themselves, whose on-demand traces never come.

Every clock is injected: callers pass ``now``.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from profagent.analysis.findings import FindingsSnapshot
from profagent.analysis.labels import shorten
from profagent.analysis.trace import diff as trace_diff
from profagent.analysis.trace.diff import Side

KINDS = ("hang", "regression", "manual")
BASELINE_TRACES = 8  # normal traces a rank's baseline is the median of
MIN_BASELINE = 3  # traces needed before a rank can regress
CONTRIBUTORS = 5  # top contributors of the diff named in a regression's evidence
SELF_PROFILING_SECONDS = 600.0  # a rank whose own profiler wrote a trace this recently profiles itself


@dataclass(frozen=True)
class Trigger:
    """Why a capture should happen. ``rank`` is the rank at fault, None for the whole job."""

    kind: str
    job_id: str
    rank: str | None
    reason: str
    evidence: Mapping[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.job_id)


def hang_triggers(snapshot: FindingsSnapshot | None) -> list[Trigger]:
    """One ``hang`` trigger per job with hang findings, naming the first hung rank."""
    by_job: dict[str, list] = {}
    for f in snapshot.findings if snapshot is not None else ():
        if f.finding == "hang":
            by_job.setdefault(f.job_id, []).append(f)
    out = []
    for job_id, found in sorted(by_job.items()):
        found.sort(key=lambda f: (f.since, f.rank or ""))
        ranks = [f.rank for f in found if f.rank is not None]
        out.append(Trigger("hang", job_id, found[0].rank, found[0].summary,
                           {"ranks": ranks, "since": found[0].since}))
    return out


@dataclass
class _RankSteps:
    baseline: deque = field(default_factory=lambda: deque(maxlen=BASELINE_TRACES))
    last_at: float | None = None
    slow_since: float | None = None
    steady: list = field(default_factory=list)  # reports of its first MIN_BASELINE normal traces
    slow: Any = None  # the report of its last slow trace


class RegressionDetector:
    """Step-time regressions per (job_id, rank), fed one value per new trace."""

    def __init__(self, factor: float, seconds: float) -> None:
        self.factor = factor
        self.seconds = seconds
        self._ranks: dict[tuple[str, str], _RankSteps] = {}
        self._configured: Side | None = None  # traces.baseline, pooled
        self._configured_from: tuple[Any, ...] = ()

    def set_baseline(self, reports: tuple[Any, ...]) -> None:
        """``traces.baseline`` (analysed reports, empty: none): every rank's baseline step
        time and the side its regressions are diffed against."""
        if reports is self._configured_from:
            return
        self._configured_from = reports
        try:
            self._configured = trace_diff.side("traces.baseline", [(r, r.rank) for r in reports]) if reports else None
        except ValueError:  # no step in it
            self._configured = None

    def observe(self, job_id: str, rank: str, step_seconds: float, at: float, report: Any = None) -> None:
        """A trace of ``rank`` ingested at ``at`` (wall seconds) with this mean step time
        (and its report, for the diff). A trace already seen (same ``at``) is ignored."""
        r = self._ranks.setdefault((job_id, rank), _RankSteps())
        if r.last_at is not None and at <= r.last_at:
            return
        r.last_at = at
        base = self.baseline(job_id, rank)
        if base is not None and step_seconds > self.factor * base:
            if r.slow_since is None:
                r.slow_since = at
            r.slow = report
            return  # slow traces never join the baseline
        r.slow_since = None
        r.baseline.append(step_seconds)
        if report is not None and len(r.steady) < MIN_BASELINE:
            r.steady.append(report)

    def baseline(self, job_id: str, rank: str) -> float | None:
        if self._configured is not None:
            return self._configured.step_mean
        r = self._ranks.get((job_id, rank))
        if r is None or len(r.baseline) < MIN_BASELINE:
            return None
        return statistics.median(r.baseline)

    def explain(self, job_id: str, rank: str) -> dict[str, Any]:
        """The diff of the rank's last slow trace against its baseline (traces.baseline,
        else its first steady traces): the top contributors and the verdict, as
        ``profagent diff`` computes them. Empty when either side lacks the figures."""
        r = self._ranks.get((job_id, rank))
        if r is None or r.slow is None or getattr(r.slow, "in_steps", None) is None:
            return {}
        try:
            base = self._configured or trace_diff.side("first steady traces", [(x, rank) for x in r.steady])
            d = trace_diff.diff(base, trace_diff.side("slow trace", [(r.slow, rank)]))
        except ValueError:  # no step on a side
            return {}
        return {
            "contributors": [{"kind": c["kind"], "name": shorten(c["name"], 120), "delta": c["delta"]}
                             for c in d.contributors[:CONTRIBUTORS]],
            "verdict": trace_diff.verdict(d),
            "baseline": base.label,
        }

    def triggers(self, now: float) -> list[Trigger]:
        """One trigger per job whose slowest-regressed rank has been slow ``seconds``."""
        out: dict[str, Trigger] = {}
        for (job_id, rank), r in sorted(self._ranks.items()):
            if r.slow_since is None or now - r.slow_since < self.seconds:
                continue
            base = self.baseline(job_id, rank) or statistics.median(r.baseline)
            if job_id not in out:
                why = self.explain(job_id, rank)
                out[job_id] = Trigger(
                    "regression", job_id, rank,
                    f"rank {rank} step time above {self.factor:g}x its baseline of {base:.3f} s "
                    f"for {now - r.slow_since:.0f} s" + (f": {why['verdict']}" if why else ""),
                    {"baseline_seconds": base, "slow_since": r.slow_since, "factor": self.factor, **why},
                )
        return list(out.values())

    def forget(self, live_jobs: Iterable[str]) -> None:
        live = set(live_jobs)
        for key in [k for k in self._ranks if k[0] not in live]:
            del self._ranks[key]


@dataclass(frozen=True)
class Decision:
    """What the gate did with one trigger at one tick."""

    trigger: Trigger
    action: str  # capture, rate_limited, busy


class IncidentGate:
    """At most one capture at a time, one per (kind, job) per ``period`` seconds, and
    one per episode: a trigger that stays active does not fire again."""

    def __init__(self, period: float) -> None:
        self.period = period
        self._last: dict[tuple[str, str], float] = {}  # (kind, job) -> time of the last capture
        self._active: dict[tuple[str, str], bool] = {}  # episode key -> fired or suppressed already

    def offer(self, triggers: Sequence[Trigger], busy: bool, now: float) -> list[Decision]:
        """Decide on this tick's active triggers. At most one decision says ``capture``."""
        current = {t.key for t in triggers}
        self._active = {k: v for k, v in self._active.items() if k in current}
        out = []
        for t in triggers:
            if self._active.get(t.key):
                continue  # this episode was already handled
            action = self.ask(t.key, busy, now)
            if action == "busy":
                out.append(Decision(t, action))  # still pending: retried next tick
                continue
            self._active[t.key] = True
            busy = busy or action == "capture"
            out.append(Decision(t, action))
        return out

    def ask(self, key: tuple[str, str], busy: bool, now: float) -> str:
        """capture (and remember it), rate_limited or busy. A `manual` request asks here
        directly: each request is its own episode."""
        if busy:
            return "busy"
        last = self._last.get(key)
        if last is not None and now - last < self.period:
            return "rate_limited"
        self._last[key] = now
        return "capture"

    def retry_after(self, key: tuple[str, str], now: float) -> float:
        last = self._last.get(key)
        return 0.0 if last is None else max(0.0, self.period - (now - last))


@dataclass(frozen=True)
class Stored:
    id: str
    time: float
    bytes: int


def to_remove(stored: Sequence[Stored], max_count: int, max_bytes: int) -> list[str]:
    """Ids of the oldest incidents to delete so at most ``max_count`` remain and their
    total stays within ``max_bytes``. The newest incident is always kept."""
    ordered = sorted(stored, key=lambda s: (s.time, s.id))
    total = sum(s.bytes for s in ordered)
    out = []
    while len(ordered) > 1 and (len(ordered) > max_count or total > max_bytes):
        old = ordered.pop(0)
        total -= old.bytes
        out.append(old.id)
    return out


@dataclass(frozen=True)
class LatestTrace:
    """A rank's latest ingested trace: ``on_demand`` if the agent requested it, else the
    job's own torch.profiler wrote it (the watched folder)."""

    job_id: str
    rank: str
    file: str
    on_demand: bool
    ingested_at: float  # wall clock


def self_profiling(latest: Iterable[LatestTrace], job_id: str, now: float,
                   window: float = SELF_PROFILING_SECONDS) -> dict[str, LatestTrace]:
    """rank -> its latest trace, for the job's ranks whose own profiler wrote a trace in the
    last ``window`` seconds. libkineto runs one profiler at a time: such a rank takes an
    on-demand request (its polls say it can trace between its own windows) and drops it."""
    return {t.rank: t for t in latest
            if t.job_id in ("", job_id) and not t.on_demand and 0 <= now - t.ingested_at <= window}

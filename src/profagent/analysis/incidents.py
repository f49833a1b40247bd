"""Incident decisions (pure, no I/O): what triggers a capture, when, and what to delete.

Every clock is injected: callers pass ``now``.
"""

from __future__ import annotations

import re
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from profagent.analysis.trace import diff as trace_diff
from profagent.analysis.trace.diff import Side
from profagent.contracts import FindingsSnapshot
from profagent.labels import shorten

# - ``hang_triggers``: one trigger per job with an active ``hang`` finding.
# - ``RegressionDetector``: a rank's trace step time above ``factor`` x its own recent
#   baseline (median of its last normal traces, or ``traces.baseline``) for ``seconds``;
#   its evidence names the top contributors of the diff of the slow trace against the
#   baseline (``traces.baseline``, else the rank's first steady traces), as ``profagent diff``.
# - ``IncidentGate``: turns the triggers seen at each tick into captures: an episode (a
#   trigger kind for a job, active from one tick to the next) fires once, only when a
#   capture slot is free, and at most once per job and kind per ``period``; its last
#   captures can be exported and restored (they survive a restart).
# - ``diagnosis``: what a trigger says, less the seconds it has lasted.
# - ``to_remove``: which stored incidents go so that count and bytes stay bounded, per job,
#   per user and in all (``Retention``), one user's evicting only its own.
# - ``self_profiling``: the ranks that profile themselves, whose on-demand traces never come.
TRIGGER_KINDS = ("hang", "regression", "manual")
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
    """One ``hang`` trigger per job with hang findings, naming the first hung rank (or, for a
    job-level finding, its first culprit), with the finding's whole evidence."""
    by_job: dict[str, list] = {}
    for f in snapshot.findings if snapshot is not None else ():
        if f.finding == "hang":
            by_job.setdefault(f.job_id, []).append(f)
    out = []
    for job_id, found in sorted(by_job.items()):
        found.sort(key=lambda f: (f.since, f.rank or ""))
        ranks = [f.rank for f in found if f.rank is not None]
        first = found[0]
        # Who and since when, then the finding's whole evidence (roles, frames, stall
        # seconds...), which wins where both name a key.
        evidence: dict[str, Any] = {"ranks": ranks, "since": first.since, **dict(first.evidence)}
        if first.advice:
            evidence["advice"] = first.advice
        if len(found) > 1:
            evidence["other_findings"] = [f.as_dict() for f in found[1:]]
        culprits = [str(r) for r in evidence.get("culprit_ranks") or ()]
        rank = first.rank if first.rank is not None else (culprits[0] if culprits else None)
        out.append(Trigger("hang", job_id, rank, first.summary, evidence))
    return out


_SECONDS = re.compile(r"\b\d+(?:\.\d+)? s\b")


def diagnosis(t: Trigger) -> tuple[Any, ...]:
    """What a trigger says, less what only ages (seconds stalled): a bundle whose trigger's
    diagnosis changes while its incident is open gets its summary rewritten."""
    return (t.rank, _SECONDS.sub("N s", t.reason), tuple(t.evidence.get("culprit_ranks") or ()))


@dataclass
class _RankSteps:
    baseline: deque = field(default_factory=lambda: deque(maxlen=BASELINE_TRACES))
    last_at: float | None = None
    slow_since: float | None = None
    steady: list = field(default_factory=list)  # reports of its first MIN_BASELINE normal traces
    slow: Any = None  # the report of its last slow trace
    slow_seconds: float = 0.0  # the step time of its last slow value


class RegressionDetector:
    """Step-time regressions per (job_id, rank), fed one value per new trace (or per
    period of the kernel probes' p50: ``measured_by`` says which, in the reason)."""

    def __init__(self, factor: float, seconds: float, measured_by: str = "traces") -> None:
        self.factor = factor
        self.seconds = seconds
        self.measured_by = measured_by
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
            r.slow, r.slow_seconds = report, step_seconds
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
                    f"rank {rank} step time ({self.measured_by}) above {self.factor:g}x its baseline of "
                    f"{base:.3f} s for {now - r.slow_since:.0f} s" + (f": {why['verdict']}" if why else ""),
                    {"baseline_seconds": base, "step_seconds": r.slow_seconds, "slow_since": r.slow_since,
                     "factor": self.factor, "measured_by": self.measured_by, **why},
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


Busy = bool | Callable[[tuple[str, str]], bool]  # whether a capture for (kind, job) must wait now


class IncidentGate:
    """At most one capture per (kind, job) per ``period`` seconds, one per episode (a
    trigger that stays active does not fire again), and none while ``busy`` says the
    capture slots are taken. ``busy`` is a bool (one capture at a time: after a capture
    decision the rest of the tick is busy) or a callable asked per trigger, which may
    reserve a slot when it answers False: it is asked only for a trigger that would
    otherwise be captured."""

    def __init__(self, period: float) -> None:
        self.period = period
        self._last: dict[tuple[str, str], float] = {}  # (kind, job) -> time of the last capture
        self._active: dict[tuple[str, str], bool] = {}  # episode key -> fired or suppressed already

    def offer(self, triggers: Sequence[Trigger], busy: Busy, now: float) -> list[Decision]:
        """Decide on this tick's active triggers."""
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
            if not callable(busy):
                busy = busy or action == "capture"
            out.append(Decision(t, action))
        return out

    def ask(self, key: tuple[str, str], busy: Busy, now: float) -> str:
        """capture (and remember it), rate_limited or busy. A `manual` request asks here
        directly: each request is its own episode."""
        last = self._last.get(key)
        if last is not None and now - last < self.period:
            return "rate_limited"
        if busy(key) if callable(busy) else busy:
            return "busy"
        self._last[key] = now
        return "capture"

    def retry_after(self, key: tuple[str, str], now: float) -> float:
        last = self._last.get(key)
        return 0.0 if last is None else max(0.0, self.period - (now - last))

    def export(self, now: float) -> dict[tuple[str, str], float]:
        """The captures still inside their period (what must survive a restart)."""
        return {k: t for k, t in self._last.items() if now - t < self.period}

    def restore(self, last: Mapping[tuple[str, str], float], now: float) -> None:
        """Captures remembered from before a restart; a time in the future (clock set back,
        or a forged file) counts as now, so it delays one period at most."""
        for key, t in last.items():
            self._last[key] = max(self._last.get(key, 0.0), min(float(t), now))


@dataclass(frozen=True)
class Stored:
    id: str
    time: float
    bytes: int
    job_id: str = ""
    uid: int = -1  # the real uid of the job's processes (-1: unknown)


@dataclass(frozen=True)
class Retention:
    """How many incidents, and bytes, are kept: in all, per job, and per user. 0 = no cap."""

    max_count: int
    max_bytes: int
    max_count_per_job: int = 0
    max_count_per_user: int = 0
    max_bytes_per_user: int = 0


def to_remove(stored: Sequence[Stored], max_count: int | Retention, max_bytes: int = 0) -> list[str]:
    """Ids of the incidents to delete, oldest first, so that every cap holds. The newest
    incident is always kept (also each job's and each user's newest, under their caps).

    A job or a user over its own cap loses its own oldest. Over the global caps, the user
    holding the most (count, then bytes) loses its oldest: one user's incidents can evict
    only that user's own while another user holds fewer."""
    caps = max_count if isinstance(max_count, Retention) else Retention(max_count, max_bytes)
    kept = sorted(stored, key=lambda s: (s.time, s.id))
    out: list[str] = []

    def drop(victim: Stored) -> None:
        kept.remove(victim)
        out.append(victim.id)

    def over(group: Callable[[Stored], object], count: int, nbytes: int) -> None:
        groups: dict[object, list[Stored]] = {}
        for s in kept:
            groups.setdefault(group(s), []).append(s)
        for items in groups.values():  # each oldest first
            while len(items) > 1 and ((count and len(items) > count) or (nbytes and sum(i.bytes for i in items) > nbytes)):
                drop(items.pop(0))

    if caps.max_count_per_job:
        over(lambda s: (s.uid, s.job_id), caps.max_count_per_job, 0)
    if caps.max_count_per_user or caps.max_bytes_per_user:
        over(lambda s: s.uid, caps.max_count_per_user, caps.max_bytes_per_user)
    while len(kept) > 1 and (len(kept) > caps.max_count or sum(s.bytes for s in kept) > caps.max_bytes):
        newest = kept[-1]
        by_user: dict[int, list[Stored]] = {}
        for s in kept:
            if s is not newest:
                by_user.setdefault(s.uid, []).append(s)
        by_count = len(kept) > caps.max_count
        heaviest = max(by_user.values(), key=lambda items: (
            (len(items), sum(i.bytes for i in items)) if by_count else (sum(i.bytes for i in items), len(items)),
            -items[0].time))
        drop(heaviest[0])
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

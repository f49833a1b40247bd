"""The evaluator: keeps the short histories the analyzers need, bundles them with the
latest snapshots into ``AnalysisInputs``, runs the analyzers (``HANG``, then
``ANALYZERS``), holds the kinds that must last a while (``HELD``), and keeps each
finding's ``since`` while it stays active. Pure: the caller passes ``now``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

from profagent.analysis.findings import bound, gpu, hang, leak, ranks, steps
from profagent.analysis.findings.bound import warmed_up
from profagent.analysis.findings.history import CountsWindow, MemorySeries
from profagent.analysis.findings.inputs import AnalysisInputs, Analyzer, MemoryInput, RankShares
from profagent.analysis.findings.steady import Steady
from profagent.config import FindingsConfig
from profagent.contracts import (
    SEVERITIES,
    Finding,
    FindingKind,
    FindingsSnapshot,
    RankStall,
    RankTrace,
    StateView,
)

MAIN, DATALOADER = "main", "dataloader"


class AnalyzerModule(Protocol):
    """A module of analysis/findings that the evaluator runs."""

    ANALYZERS: tuple[Analyzer, ...]
    WINDOW_HELD: frozenset[FindingKind]


# Two phases. First the hang analyzer: its findings make ``hung`` (the jobs with a hang),
# which the second phase reads (no straggler nor gpu_idle in a hung job: a hang explains
# them). Then the analyzers of every module below, in this order (steps first: its arrival
# straggler is kept over the stack-based one, one finding per kind and rank). A module
# declares its ``ANALYZERS`` and the kinds steady.py holds (``WINDOW_HELD``): a new finding
# kind is its name in ``FindingKind`` and one module here, named on the line below.
HANG: Analyzer = hang.analyze
MODULES: tuple[AnalyzerModule, ...] = (steps, bound, leak, gpu, ranks)
ANALYZERS: tuple[Analyzer, ...] = tuple(analyze for module in MODULES for analyze in module.ANALYZERS)
WINDOW_HELD: frozenset[FindingKind] = frozenset().union(*(module.WINDOW_HELD for module in MODULES))
# A rank whose stack has not changed this long may be hanging: no finding is held for its job
# (recording.yml gates the job-level straggler on the same 30 s).
FROZEN_SECONDS = 30.0
# Kinds reported only once their evidence has lasted this config value (seconds).
HELD: Mapping[FindingKind, str] = {"gpu_idle": "gpu_idle_seconds"}


class Evaluator:
    def __init__(self, config: FindingsConfig) -> None:
        self.config = config
        self._seen: dict[str, object] = {}  # source -> the snapshot already folded into histories
        self._shares: dict[tuple[str, str], CountsWindow] = {}
        self._waits: dict[tuple[str, str], CountsWindow] = {}  # judged samples and collective waits
        self._run_queue: dict[tuple[str, str], CountsWindow] = {}  # a rank's main thread waiting for a CPU
        self._evaluations = 0
        self._functions: dict[tuple[str, str], tuple[tuple[str, int], ...]] = {}
        self._memory: dict[tuple[str, str, str], MemorySeries] = {}
        self._errors: dict[tuple[int, str], CountsWindow] = {}  # (gpu, uuid) -> error counters
        self._pending: dict[tuple[str, str, str], float] = {}
        self._since: dict[tuple[str, str, str], float] = {}
        self._hung: frozenset[str] = frozenset()  # jobs with a hang finding at the last evaluation
        # window-judged findings held after their last sighting; a straggler confirmed first
        self._steady = Steady(config.hold_seconds, WINDOW_HELD, confirm_seconds=config.straggler_confirm_seconds)

    # -- histories ----------------------------------------------------------------------
    def _new(self, name: str, snapshot: object) -> bool:
        if snapshot is None or self._seen.get(name) is snapshot:
            return False
        self._seen[name] = snapshot
        return True

    def _observe(self, view: StateView, now: float) -> None:
        cfg = self.config
        stacks, host, gpu = view.stacks, view.host, view.gpu
        if self._new("stacks", stacks):
            for g in stacks.groups:
                if g.role == MAIN:
                    key = (g.job_id or stacks.job_id, g.rank)
                    self._shares.setdefault(key, CountsWindow(cfg.window_seconds)).add(now, dict(g.categories))
                    self._functions[key] = g.functions
                    if g.judged:  # from the first judged window on: warm-up is measured from there
                        self._waits.setdefault(key, CountsWindow(cfg.window_seconds)).add(
                            now, {"judged": g.judged, "waits": g.collective_wait})
        if self._new("host", host):
            for g in host.groups:
                if g.role not in (MAIN, DATALOADER) or not g.processes:
                    continue
                if g.role == MAIN and g.usage.run_queue is not None:
                    self._run_queue.setdefault((g.job_id, g.rank), CountsWindow(cfg.window_seconds)).add(
                        now, {"run_queue": g.usage.run_queue})
                uss = getattr(g.usage, "uss", None)
                value = uss if (g.role == DATALOADER and uss is not None) else g.usage.rss
                self._series((g.job_id, g.rank, f"host:{g.role}"), now, value)
        if self._new("gpu", gpu):
            for p in gpu.processes:
                if p.memory_bytes is not None:
                    self._series((p.job_id or gpu.job_id, p.rank, f"gpu:{p.gpu}"), now, p.memory_bytes)
            for d in gpu.devices:
                counts = {f"xid {x}": n for x, n in d.xid_errors.items()}
                ecc = d.values.get("ecc_uncorrected_errors")
                if ecc is not None:
                    counts["ecc_uncorrected"] = int(ecc)
                self._errors.setdefault((d.index, d.uuid), CountsWindow(cfg.gpu_errors_seconds)).add(now, counts)

    def _series(self, key: tuple[str, str, str], now: float, value: float) -> None:
        self._memory.setdefault(key, MemorySeries(self.config.leak_window_seconds)).add(now, value)

    def _rank_shares(self, now: float) -> list[RankShares]:
        out = []
        for (job, rank), w in sorted(self._shares.items()):
            waits = self._waits.get((job, rank))
            delta = waits.delta() if waits is not None else {}
            judged_for = now - waits.first_seen if waits is not None and waits.first_seen is not None else 0.0
            out.append(RankShares(job, rank, w.delta(), now - (w.first_seen or now), self._functions.get((job, rank), ()),
                                  delta.get("judged", 0), delta.get("waits", 0.0), judged_for,
                                  *self._run_queue_of(job, rank)))
        return out

    def _run_queue_of(self, job: str, rank: str) -> tuple[float, float]:
        """(seconds its main thread waited for a CPU, seconds read over) in the window."""
        w = self._run_queue.get((job, rank))
        return (w.delta().get("run_queue", 0.0), w.span()) if w is not None else (0.0, 0.0)

    def _memory_inputs(self, view: StateView) -> list[MemoryInput]:
        host, gpu = view.host, view.gpu
        free = {}
        if gpu is not None:
            free = {d.index: d.values.get("memory_free_bytes") for d in gpu.devices if d.up}
        inputs = []
        for (job, rank, what), series in sorted(self._memory.items()):
            kind, _, name = what.partition(":")
            if kind == "host":
                label = ("host memory (USS) of the DataLoader workers" if name == DATALOADER
                         else "host memory (RSS)")
                available = host.node.memory_available if host is not None else None
            else:
                label, available = f"GPU {name} memory", free.get(int(name))
            inputs.append(MemoryInput(job, rank, label, kind, series, available))
        return inputs

    def _forget(self, view: StateView) -> None:
        """Drop histories of ranks the sources no longer report (a job that ended)."""
        stacks, host, gpu = view.stacks, view.host, view.gpu
        if stacks is not None:
            live = {(g.job_id or stacks.job_id, g.rank) for g in stacks.groups}
            self._shares = {k: v for k, v in self._shares.items() if k in live}
            self._waits = {k: v for k, v in self._waits.items() if k in live}
        if host is not None or gpu is not None:
            live_mem = {(g.job_id, g.rank, f"host:{g.role}") for g in (host.groups if host else ())}
            if host is not None:
                live = {(g.job_id, g.rank) for g in host.groups if g.role == MAIN}
                self._run_queue = {k: v for k, v in self._run_queue.items() if k in live}
            live_mem |= {(p.job_id or gpu.job_id, p.rank, f"gpu:{p.gpu}") for p in (gpu.processes if gpu else ())}
            self._memory = {k: v for k, v in self._memory.items() if k in live_mem}

    # -- evaluation ----------------------------------------------------------------------
    def evaluate(self, sources: StateView | Mapping[str, object], now: float) -> FindingsSnapshot:
        """Every finding active at ``now`` (wall clock) from the latest snapshot of each
        source (a view, or snapshots by source name)."""
        view = sources if isinstance(sources, StateView) else StateView.of(sources)
        cfg = self.config
        self._observe(view, now)
        self._forget(view)
        inputs = self._inputs(view, now)
        found = HANG(inputs)
        hung = self._hung = frozenset(f.job_id for f in found if f.finding == "hang")
        inputs = dataclasses.replace(inputs, hung=hung)
        for analyze in ANALYZERS:
            found += analyze(inputs)
        # window-judged kinds held after their last sighting, never through a hang: one found,
        # a rank frozen for FROZEN_SECONDS or stalled, or the job's steps stopped (the same
        # gates as the job-level straggler rule); a mere suspicion (one window with an
        # unchanged stack, common for a rank waiting for a straggler) pauses the analyzers, not the hold
        frozen = {s.job_id for s in inputs.stalls if s.stalled or s.unchanged_seconds >= FROZEN_SECONDS}
        stopped = {f.job_id for f in found if f.finding == "stall"}
        # a rank is still measured while its stacks or its probes are (an agent with no stacks
        # holds its arrival straggler too)
        measured = {(s.job_id, s.rank) for s in inputs.shares}
        if view.timeline is not None:
            measured |= {(r.job_id, r.rank) for r in view.timeline.ranks}
        found = self._steady(found, now, measured, hung | frozen | stopped)
        found = [f for f in found if f.finding not in HELD] + self._hold(
            [f for f in found if f.finding in HELD], now)
        self._evaluations += 1
        waits = tuple((s.job_id, s.rank, round(s.wait_share, 4)) for s in inputs.shares if warmed_up(s, cfg))
        steps = view.timeline.ranks if view.timeline is not None else ()
        return FindingsSnapshot(self._stamp(found, now), now, waits, self._evaluations, steps)

    def _inputs(self, view: StateView, now: float) -> AnalysisInputs:
        stacks, traces, gpu = view.stacks, view.traces, view.gpu
        rank_traces = tuple(_with_job(r, traces.job_id) for r in traces.ranks) if traces is not None else ()
        stalls = tuple(_stall_with_job(s, stacks.job_id) for s in stacks.stalls) if stacks is not None else ()
        errors = {index: w.delta() for (index, _), w in self._errors.items()} if gpu is not None else {}
        return AnalysisInputs(
            config=self.config, now=now, host=view.host, gpu=gpu, stacks=stacks, traces=traces, timeline=view.timeline,
            shares=tuple(self._rank_shares(now)), rank_traces=rank_traces, stalls=stalls,
            memory=tuple(self._memory_inputs(view)), gpu_errors=errors, was_hung=self._hung,
            suspected=frozenset(s.job_id for s in stalls if s.suspected or s.stalled))

    def _hold(self, candidates: list[Finding], now: float) -> list[Finding]:
        """Findings whose evidence has lasted their kind's ``HELD`` seconds; ``since`` is
        when it began."""
        keys = {f.key for f in candidates}
        for key in [k for k in self._pending if k not in keys]:
            del self._pending[key]
        out = []
        for f in candidates:
            began = self._pending.setdefault(f.key, now)
            if now - began >= getattr(self.config, HELD[f.finding]):
                self._since.setdefault(f.key, began)
                out.append(f)
        return out

    def _stamp(self, found: list[Finding], now: float) -> tuple[Finding, ...]:
        unique: dict[tuple[str, str, str], Finding] = {}
        for f in found:  # one finding per (kind, job, rank): the most severe
            old = unique.get(f.key)
            if old is None or SEVERITIES.index(f.severity) > SEVERITIES.index(old.severity):
                unique[f.key] = f
        self._since = {k: v for k, v in self._since.items() if k in unique}
        out = []
        for key, f in unique.items():
            since = self._since.setdefault(key, now)
            out.append(dataclasses.replace(f, since=since))
        return tuple(sorted(out, key=sort_key))


def sort_key(f: Finding) -> tuple[int, str, str, str]:
    """Most severe first, then by kind, job and rank."""
    return (-SEVERITIES.index(f.severity), f.finding, f.job_id, f.rank or "")


def _with_job(rt: RankTrace, job_id: str) -> RankTrace:
    return rt if rt.job_id or not job_id else dataclasses.replace(rt, job_id=job_id)


def _stall_with_job(s: RankStall, job_id: str) -> RankStall:
    return s if s.job_id else dataclasses.replace(s, job_id=job_id)

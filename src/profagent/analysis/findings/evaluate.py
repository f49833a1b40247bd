"""The evaluator: feeds the latest snapshots of every source to the analyzers, keeps the
short histories they need, holds findings that must last a while (``gpu_idle``), and
keeps each finding's ``since`` while it stays active. Pure: the caller passes ``now``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from profagent.analysis.findings import SEVERITIES, Finding, FindingsSnapshot
from profagent.analysis.findings.bound import RankShares, bound, straggler, warmed_up
from profagent.analysis.findings.gpu import gpu_errors, gpu_idle, gpu_throttled
from profagent.analysis.findings.hang import hang, held_up_ranks
from profagent.analysis.findings.history import CountsWindow, MemorySeries
from profagent.analysis.findings.leak import MemoryInput, memory_leak
from profagent.config import FindingsConfig

MAIN, DATALOADER = "main", "dataloader"


class Evaluator:
    def __init__(self, config: FindingsConfig) -> None:
        self.config = config
        self._seen: dict[str, Any] = {}  # source -> the snapshot already folded into histories
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

    # -- histories ----------------------------------------------------------------------
    def _new(self, name: str, snapshot: Any) -> bool:
        if snapshot is None or self._seen.get(name) is snapshot:
            return False
        self._seen[name] = snapshot
        return True

    def _observe(self, snapshots: Mapping[str, Any], now: float) -> None:
        cfg = self.config
        stacks, host, gpu = snapshots.get("stacks"), snapshots.get("host"), snapshots.get("gpu")
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

    def _memory_inputs(self, snapshots: Mapping[str, Any]) -> list[MemoryInput]:
        host, gpu = snapshots.get("host"), snapshots.get("gpu")
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

    def _forget(self, snapshots: Mapping[str, Any]) -> None:
        """Drop histories of ranks the sources no longer report (a job that ended)."""
        stacks, host, gpu = snapshots.get("stacks"), snapshots.get("host"), snapshots.get("gpu")
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
    def evaluate(self, snapshots: Mapping[str, Any], now: float) -> FindingsSnapshot:
        """Every finding active at ``now`` (wall clock) from the latest snapshot of each source."""
        cfg = self.config
        self._observe(snapshots, now)
        self._forget(snapshots)
        stacks, traces, gpu = snapshots.get("stacks"), snapshots.get("traces"), snapshots.get("gpu")
        shares = self._rank_shares(now)
        rank_traces = list(traces.ranks) if traces is not None else []
        for rt in rank_traces:
            if not rt.job_id and traces.job_id:
                rank_traces = [_with_job(r, traces.job_id) for r in rank_traces]
                break

        found: list[Finding] = []
        suspected: set[str] = set()
        held_up: set[tuple[str, str]] = set()
        if stacks is not None:
            stalls = [_stall_with_job(s, stacks.job_id) for s in stacks.stalls]
            for job in sorted({s.job_id for s in stalls}):
                found += hang(stalls, job, settled=job in self._hung)
            suspected = {s.job_id for s in stalls if s.suspected or s.stalled}
            held_up = held_up_ranks(stalls)
        hung = self._hung = frozenset(f.job_id for f in found if f.finding == "hang")
        # a rank whose stack stands still may be hanging: no straggler then (it waits least)
        found += straggler(shares, rank_traces, cfg, hung | suspected)
        found += bound(shares, rank_traces, cfg, held_up)
        found += memory_leak(self._memory_inputs(snapshots), cfg)
        held: list[Finding] = []
        if gpu is not None:
            activity = {(s.job_id, s.rank): s.top() for s in shares if s.total}
            held = gpu_idle(gpu, cfg, activity) if not hung else []
            found += gpu_throttled(gpu)
            errors = {index: w.delta() for (index, _), w in self._errors.items()}
            found += gpu_errors(gpu, errors)
        found += self._hold(held, cfg.gpu_idle_seconds, now)
        self._evaluations += 1
        waits = tuple((s.job_id, s.rank, round(s.wait_share, 4)) for s in shares if warmed_up(s, cfg))
        return FindingsSnapshot(self._stamp(found, now), now, waits, self._evaluations)

    def _hold(self, candidates: list[Finding], seconds: float, now: float) -> list[Finding]:
        """Findings whose evidence has lasted ``seconds``; ``since`` is when it began."""
        keys = {f.key for f in candidates}
        for key in [k for k in self._pending if k not in keys]:
            del self._pending[key]
        out = []
        for f in candidates:
            began = self._pending.setdefault(f.key, now)
            if now - began >= seconds:
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


def _with_job(rt: Any, job_id: str) -> Any:
    return dataclasses.replace(rt, job_id=rt.job_id or job_id)


def _stall_with_job(s: Any, job_id: str) -> Any:
    return s if s.job_id else dataclasses.replace(s, job_id=job_id)

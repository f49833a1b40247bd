"""GET /api/ranks: everything `profagent top` shows, per job and per rank, in one JSON call.

``ranks_payload`` is pure over the agent's StateViews, so `top --pid` (in-process) and
`top --url` (over HTTP) render the same data. Rates (CPU %) and recent shares (stack
categories, top function) need a baseline: ``CounterHistory`` keeps a few seconds of
cumulative counters per rank, and the payload describes the change since then.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from profagent.contracts import ROLE_DATALOADER, ROLE_MAIN, GpuSnapshot, RankSteps, StateView

RankKey = tuple[str, str]  # (job_id, rank)
HISTORY_SECONDS = 10.0  # rates and shares describe about this many recent seconds
TOP_FUNCTIONS = 8


@dataclass(frozen=True)
class Counters:
    """Cumulative readings of one rank at one time (``time`` = when the host source read them)."""

    time: float | None
    cpu_seconds: float | None
    categories: Mapping[str, int] = field(default_factory=dict)
    functions: Mapping[str, int] = field(default_factory=dict)


class CounterHistory:
    """Recent ``Counters`` per rank; ``baseline`` is the oldest one within ``horizon`` seconds."""

    def __init__(self, horizon: float = HISTORY_SECONDS) -> None:
        self.horizon = horizon
        self._samples: dict[RankKey, deque[Counters]] = {}

    def baseline(self, key: RankKey, now: Counters) -> Counters | None:
        """Record ``now`` (if it is newer than the last reading) and return the baseline to diff against."""
        samples = self._samples.setdefault(key, deque())
        if now.time is not None and (not samples or samples[-1].time is None or now.time > samples[-1].time):
            samples.append(now)
        while len(samples) > 2 and now.time is not None and samples[1].time is not None and now.time - samples[1].time >= self.horizon:
            samples.popleft()
        return samples[0] if samples and samples[0] is not now else None

    def forget_except(self, keys: set[RankKey]) -> None:
        for key in [k for k in self._samples if k not in keys]:
            del self._samples[key]


def current_counters(view: StateView) -> dict[RankKey, Counters]:
    """The cumulative counters of every rank of one job view."""
    host, stacks = view.host, view.stacks
    health = view.health.get("host")
    when = health.last_success if health is not None else None
    out: dict[RankKey, Counters] = {}
    for key in _rank_keys(view):
        cpu = None
        if host is not None:
            usages = [g.usage for g in host.groups if (g.job_id, g.rank) == key and g.role in (ROLE_MAIN, ROLE_DATALOADER)]
            cpu = sum(u.cpu_user + u.cpu_system for u in usages) if usages else None
        cats: dict[str, int] = {}
        funcs: dict[str, int] = {}
        if stacks is not None:
            for g in stacks.groups:
                if (g.job_id or stacks.job_id, g.rank) == key and g.role == ROLE_MAIN:
                    cats.update(g.categories)
                    funcs.update(g.functions)
        out[key] = Counters(when, cpu, cats, funcs)
    return out


def _rank_keys(view: StateView) -> list[RankKey]:
    tree = view.tree
    if tree is None:
        return []
    keys = {(p.job_id or tree.job_id, p.rank) for p in tree.processes if p.role == ROLE_MAIN}
    return sorted(keys, key=lambda k: (k[0], int(k[1]) if k[1].isdigit() else 1 << 30, k[1]))


def _shares(now: Mapping[str, int], before: Mapping[str, int] | None) -> tuple[dict[str, float], bool]:
    """Shares of the change since ``before``; the whole run's shares if nothing changed. (shares, recent?)"""
    if before is not None:
        delta = {k: max(0, n - before.get(k, 0)) for k, n in now.items()}
        total = sum(delta.values())
        if total > 0:
            return {k: n / total for k, n in delta.items() if n}, True
    total = sum(now.values())
    return ({k: n / total for k, n in now.items() if n} if total else {}), False


def _gpu_of_rank(gpu: GpuSnapshot | None, key: RankKey) -> dict[str, Any] | None:
    if gpu is None:
        return None
    mine = [p for p in gpu.processes if (p.job_id or gpu.job_id, p.rank) == key and p.role == ROLE_MAIN]
    if not mine:
        return None
    devices = {d.index: d for d in gpu.devices if d.up}
    utils = [p.sm_ratio for p in mine if p.sm_ratio is not None]
    if not utils:  # no per-process utilisation: the devices' own
        utils = [devices[p.gpu].values["utilization_ratio"] for p in mine
                 if p.gpu in devices and "utilization_ratio" in devices[p.gpu].values]
    memory = [p.memory_bytes for p in mine if p.memory_bytes is not None]
    return {
        "gpus": sorted({p.gpu for p in mine}),
        "utilization_ratio": max(utils) if utils else None,
        "memory_bytes": sum(memory) if memory else None,
    }


def gpu_summary(gpu: GpuSnapshot | None) -> dict[str, Any] | None:
    """Node GPUs in one line's worth of numbers; None when the GPU source is off."""
    if gpu is None:
        return None
    up = [d for d in gpu.devices if d.up]
    utils = [d.values["utilization_ratio"] for d in up if "utilization_ratio" in d.values]
    used = [d.values["memory_used_bytes"] for d in up if "memory_used_bytes" in d.values]
    total = [d.values["memory_total_bytes"] for d in up if "memory_total_bytes" in d.values]
    return {
        "count": len(gpu.devices),
        "up": len(up),
        "names": sorted({d.name for d in gpu.devices}),
        "simulated": bool(gpu.simulated),
        "utilization_ratio": sum(utils) / len(utils) if utils else None,
        "memory_used_bytes": sum(used) if used else None,
        "memory_total_bytes": sum(total) if total else None,
    }


def _rank_row(view: StateView, key: RankKey, now: Counters, before: Counters | None, wall: float) -> dict[str, Any]:
    tree = view.tree
    assert tree is not None
    procs = [p for p in tree.processes if (p.job_id or tree.job_id, p.rank) == key]
    mains = [p for p in procs if p.role == ROLE_MAIN]
    host, stacks, traces, timeline = view.host, view.stacks, view.traces, view.timeline

    groups = {g.role: g for g in (host.groups if host is not None else ()) if (g.job_id, g.rank) == key}
    main_usage = groups[ROLE_MAIN].usage if ROLE_MAIN in groups else None
    workers = groups.get(ROLE_DATALOADER)
    cpu_percent = None
    if before is not None and now.cpu_seconds is not None and before.cpu_seconds is not None \
            and now.time is not None and before.time is not None and now.time > before.time:
        cpu_percent = 100.0 * max(0.0, now.cpu_seconds - before.cpu_seconds) / (now.time - before.time)

    stall = next((s for s in (stacks.stalls if stacks is not None else ())
                  if (s.job_id or stacks.job_id, s.rank) == key), None)
    categories, recent = _shares(now.categories, before.categories if before else None)
    functions, _ = _shares({k: v for k, v in now.functions.items()}, before.functions if before else None)
    ranked = sorted(functions.items(), key=lambda kv: -kv[1])
    top = next(((name, share) for name, share in ranked if name != "other"), None)

    trace = next((t for t in (traces.ranks if traces is not None else ())
                  if (t.job_id or traces.job_id, t.rank) == key), None)
    step = None
    if trace is not None and trace.report.step_mean is not None:
        step = {"mean_seconds": trace.report.step_mean, "max_seconds": trace.report.step_max,
                "steps": len(trace.report.steps), "age_seconds": max(0.0, wall - trace.ingested_at)}
    steps = next((r for r in (timeline.ranks if timeline is not None else ()) if (r.job_id, r.rank) == key), None)
    return {
        "rank": key[1],
        "local_rank": mains[0].local_rank if mains else "",
        "pid": mains[0].pid if mains else None,
        "state": "stalled" if stall is not None and stall.stalled else "running",
        "stalled_seconds": stall.unchanged_seconds if stall is not None and stall.stalled else None,
        "unchanged_seconds": stall.unchanged_seconds if stall is not None else None,
        "categories": categories,
        "categories_recent": recent,
        "top_function": top[0] if top else None,
        "top_function_share": top[1] if top else None,
        "functions": [{"function": n, "share": s} for n, s in ranked[:TOP_FUNCTIONS]],
        "cpu_percent": cpu_percent,
        "rss_bytes": main_usage.rss if main_usage is not None else None,
        "uss_bytes": getattr(main_usage, "uss", None),  # present once the host source reads USS
        "threads": main_usage.threads if main_usage is not None else None,
        "workers": workers.processes if workers is not None else 0,
        "workers_rss_bytes": workers.usage.rss if workers is not None else None,
        "gpu": _gpu_of_rank(view.gpu, key),
        "step": step,
        "timeline": _timeline_of(steps),
    }


def _timeline_of(steps: RankSteps | None) -> dict[str, Any] | None:
    """The rank's steps from the kernel probes, over the timeline window."""
    if steps is None:
        return None
    return {
        "optimizer_steps": steps.optimizer_steps, "p50_seconds": steps.p50, "p90_seconds": steps.p90,
        "max_seconds": steps.max, "steps_per_second": steps.steps_per_second, "micro_batches": steps.micro_batches,
        "stage_shares": dict(steps.stage_shares), "stage_now": steps.stage_now or None,
        "idle_seconds": steps.idle_seconds,
        "step_boundary": steps.step_boundary or None, "steps_note": steps.steps_note or None,
    }


def findings_of(view: StateView) -> list[dict[str, Any]]:
    """Active findings of the view (none until the findings engine publishes a snapshot)."""
    snap = view.findings
    return [f.as_dict() for f in snap.findings] if snap is not None else []


def ranks_payload(
    views: Sequence[StateView],
    baselines: Mapping[RankKey, Counters | None],
    node: str,
    wall: float,
) -> dict[str, Any]:
    """The /api/ranks document. ``baselines`` come from a CounterHistory (missing: no rates yet)."""
    jobs = []
    for view in views:
        tree = view.tree
        if tree is None:
            continue
        counters = current_counters(view)
        by_job: dict[str, list[dict[str, Any]]] = {}
        for key, now in counters.items():
            by_job.setdefault(key[0], []).append(_rank_row(view, key, now, baselines.get(key), wall))
        status = tree.job_status()
        for job_id in sorted(set(by_job) | set(status)):
            sizes = {p.world_size for p in tree.processes if (p.job_id or tree.job_id) == job_id and p.world_size}
            jobs.append({
                "job_id": job_id,
                "alive": status.get(job_id, tree.alive),
                "root_pid": tree.root_pid if tree.job_id == job_id else None,
                "world_size": int(next(iter(sizes))) if len(sizes) == 1 and next(iter(sizes)).isdigit() else None,
                "gpu": gpu_summary(view.gpu),
                "sources": {name: h.up for name, h in sorted(view.health.items())},
                "findings": [f for f in findings_of(view) if f["job_id"] in (job_id, "")],
                "ranks": by_job.get(job_id, []),
            })
    return {"node": node, "time": wall, "jobs": jobs}


class RanksApi:
    """Keeps the counter history and builds payloads; ``route`` serves GET /api/ranks."""

    def __init__(self, views: Callable[[], Sequence[StateView]], node: str,
                 wall: Callable[[], float] = time.time, horizon: float = HISTORY_SECONDS,
                 watched: Callable[[], None] = lambda: None) -> None:
        self._views, self._node, self._wall, self._watched = views, node, wall, watched
        self._history = CounterHistory(horizon)
        self._lock = threading.Lock()  # HTTP requests come from several threads

    def payload(self) -> dict[str, Any]:
        views = list(self._views())
        baselines: dict[RankKey, Counters | None] = {}
        with self._lock:
            for view in views:
                for key, now in current_counters(view).items():
                    baselines[key] = self._history.baseline(key, now)
            self._history.forget_except(set(baselines))
        return ranks_payload(views, baselines, self._node, self._wall())

    def route(self, query: dict[str, list[str]]) -> tuple[int, str, bytes]:
        self._watched()  # `profagent top --url` polls this: sample the job at the full rate
        return 200, "application/json", orjson.dumps(self.payload())

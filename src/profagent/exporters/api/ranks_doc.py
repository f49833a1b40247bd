"""The /api/ranks document as typed records: built by ranks.py, read by `profagent top` and
the demo (``read_ranks``), so that the route and its readers agree on one shape.

``read_ranks`` parses a document once, at the client: the answer comes over the network, so
a value of the wrong type (or a NaN, or an unknown finding kind) reads as its field's
default, and a record missing a field it cannot do without is left out. ``as_json`` writes
a record as the JSON-ready data the route serves (the keys are the fields, in order).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, Union

from profagent.contracts import Finding


@dataclass(frozen=True)
class FunctionShare:
    function: str  # one of the rank's busiest functions
    share: float  # of its recent main-thread samples


@dataclass(frozen=True)
class RankGpu:
    """The GPUs a rank's processes hold."""

    gpus: tuple[int, ...] = ()
    utilization_ratio: float | None = None
    memory_bytes: int | None = None


@dataclass(frozen=True)
class RankStep:
    """The rank's last profiler trace's steps."""

    mean_seconds: float | None = None
    max_seconds: float | None = None
    steps: int = 0
    age_seconds: float = 0.0


@dataclass(frozen=True)
class RankTimeline:
    """The rank's steps from the kernel probes, over the timeline window."""

    optimizer_steps: int = 0
    p50_seconds: float | None = None
    p90_seconds: float | None = None
    max_seconds: float | None = None
    steps_per_second: float | None = None
    micro_batches: float | None = None
    stage_shares: Mapping[str, float] = field(default_factory=dict)
    stage_now: str | None = None
    idle_seconds: float | None = None
    lost_events: int = 0
    step_boundary: str | None = None
    steps_note: str | None = None


@dataclass(frozen=True)
class RankRow:
    """One rank: what `top` shows in its row and its detail pane."""

    rank: str = ""
    local_rank: str = ""
    pid: int | None = None
    state: Literal["running", "stalled"] = "running"
    stalled_seconds: float | None = None
    unchanged_seconds: float | None = None
    categories: Mapping[str, float] = field(default_factory=dict)
    categories_recent: bool = False
    top_function: str | None = None
    top_function_share: float | None = None
    functions: tuple[FunctionShare, ...] = ()
    cpu_percent: float | None = None
    rss_bytes: int | None = None
    uss_bytes: int | None = None
    threads: int | None = None
    workers: int = 0
    workers_rss_bytes: int | None = None
    gpu: RankGpu | None = None
    step: RankStep | None = None
    timeline: RankTimeline | None = None

    @property
    def step_seconds(self) -> float | None:
        """The kernel probes' p50 over their window, else the mean of the last profiler trace."""
        if self.timeline is not None and self.timeline.p50_seconds is not None:
            return self.timeline.p50_seconds
        return self.step.mean_seconds if self.step is not None else None

    @property
    def lost_events(self) -> int:
        """Probe events lost where the rank ran: its step figures miss events."""
        return self.timeline.lost_events if self.timeline is not None else 0


@dataclass(frozen=True)
class NodeGpus:
    """The node's GPUs in one line's worth of numbers."""

    count: int = 0
    up: int = 0
    names: tuple[str, ...] = ()
    simulated: bool = False
    utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None


@dataclass(frozen=True)
class JobRanks:
    job_id: str = ""
    alive: bool = True
    root_pid: int | None = None
    world_size: int | None = None
    gpu: NodeGpus | None = None  # None: the GPU source is off
    sources: Mapping[str, bool] = field(default_factory=dict)  # source -> up
    findings: tuple[Finding, ...] = ()
    ranks: tuple[RankRow, ...] = ()


@dataclass(frozen=True)
class RanksDoc:
    node: str = "?"
    time: float = 0.0
    jobs: tuple[JobRanks, ...] = ()


def as_json(record: object) -> Any:
    """A record (and what it holds) as JSON-ready data."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {f.name: as_json(getattr(record, f.name)) for f in dataclasses.fields(record)}
    if isinstance(record, Mapping):
        return {k: as_json(v) for k, v in record.items()}
    if isinstance(record, list | tuple):
        return [as_json(v) for v in record]
    return record


def read_ranks(data: object) -> RanksDoc:
    """The document from its JSON; see the module's docstring for what a bad value reads as."""
    return _read(RanksDoc, data) or RanksDoc()


_R = TypeVar("_R")
_MISSING = object()


def _read(cls: type[_R], data: object) -> _R | None:
    """``cls`` from a JSON object; None when a field without a default is missing or wrong."""
    if not isinstance(data, dict):
        return None
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = _value(hints[f.name], data.get(f.name, _MISSING))
        if value is not _MISSING:
            values[f.name] = value
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            return None
    return cls(**values)


def _value(hint: Any, raw: Any) -> Any:  # noqa: PLR0911 (one return per JSON type)
    """``raw`` as ``hint`` says, or ``_MISSING``."""
    if raw is _MISSING:
        return _MISSING
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if raw is None and type(None) in args:
            return None
        return next((v for a in args if a is not type(None) and (v := _value(a, raw)) is not _MISSING), _MISSING)
    if origin is Literal:
        return raw if raw in args else _MISSING
    if hint is Any:
        return raw
    if hint is bool:
        return raw if isinstance(raw, bool) else _MISSING
    if hint is int:
        return raw if isinstance(raw, int) and not isinstance(raw, bool) else _MISSING
    if hint is float:
        ok = isinstance(raw, int | float) and not isinstance(raw, bool) and math.isfinite(raw)
        return float(raw) if ok else _MISSING
    if hint is str:
        return raw if isinstance(raw, str) else _MISSING
    if origin is tuple and isinstance(raw, list):
        items = (_value(args[0], item) for item in raw)
        return tuple(item for item in items if item is not _MISSING)
    if origin in (Mapping, dict) and isinstance(raw, dict):
        read = {k: _value(args[1], v) for k, v in raw.items() if isinstance(k, str)}
        return {k: v for k, v in read.items() if v is not _MISSING}
    if dataclasses.is_dataclass(hint):
        record = _read(hint, raw)  # type: ignore[arg-type]
        return _MISSING if record is None else record
    return _MISSING

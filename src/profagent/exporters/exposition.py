"""The /metrics body: the one render path from the latest state to the exposition.

A scrape only reads snapshots the sources already published: no /proc read, NVML call
or py-spy run happens on a scrape. Each source's families are encoded once per
snapshot, so scrapes between two source ticks cost a few dictionary lookups.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder

from profagent.contracts import StateView
from profagent.exporters.families import (
    Families,
    agent,
    gpu,
    host,
    incidents,
    ondemand,
    stacks,
    timeline,
)
from profagent.exporters.families import findings as findings_families
from profagent.exporters.families import traces as traces_families
from profagent.system.cputime import CPU, CpuAccount

Renderer = Callable[[Any, Families], None]

# source name -> how its snapshot becomes families. A new source adds one line here.
RENDERERS: dict[str, Renderer] = {
    "host": host.render,
    "gpu": gpu.render,
    "stacks": stacks.render,
    "traces": traces_families.render,
    "ondemand": ondemand.render,
    "timeline": timeline.render,
    "findings": findings_families.render,
    "incidents": incidents.render,
}


def _own_collectors(registry: CollectorRegistry) -> CollectorRegistry:
    """The agent's own process_*, python_* families (they describe the agent itself)."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class _Families:
    """A collector over families already built (to encode one block)."""

    def __init__(self, families: Families) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


_EOF = b"# EOF\n"


# Control characters in label values (names from jobs and trace files: ESC, BEL, CR, C1,
# line separators, bidi overrides) as the client library leaves them, raw: a `curl
# /metrics` in a terminal would obey them. The encoded block has no such byte of its own
# (its line breaks are the only LF; an LF inside a value is already written "\n").
_RAW_CONTROL = re.compile(rb"[\x00-\x09\x0b-\x1f\x7f]|\xc2[\x80-\x9f]|\xe2\x80[\xa8-\xae]|\xe2\x81[\xa6-\xa9]")


def _visible(match: re.Match[bytes]) -> bytes:
    """The escape labels.printable writes (``\\x1b``, ``\\u202e``), its backslash doubled as
    the exposition formats want, so a parser reads back the printable text."""
    code = ord(match.group().decode())
    return (f"\\\\x{code:02x}" if code < 0x100 else f"\\\\u{code:04x}").encode()


MAX_SERIES_PER_JOB = 5000  # agent.max_series_per_job


def _rank_order(rank: str) -> tuple[int, str]:
    return (int(rank), "") if rank.isdigit() else (1 << 30, rank)


def limit_series(families: Families, expired: frozenset[tuple[str, str]], cap: int) -> dict[str, int]:
    """Leave out of ``families`` (in place) the series of expired ranks, then, per job, the
    series past ``cap``: the job's series without a rank always stay, its ranks are kept
    lowest first while they fit. Returns job_id -> series left out by the cap."""
    per_rank: dict[str, dict[str, int]] = {}  # job -> rank ("" = none) -> series
    for metric in families:
        for sample in metric.samples:
            job = sample.labels.get("job_id")
            if job is None:
                continue
            rank = sample.labels.get("rank", "")
            if rank and (job, rank) in expired:
                continue
            ranks = per_rank.setdefault(job, {})
            ranks[rank] = ranks.get(rank, 0) + 1
    cut: set[tuple[str, str]] = set()
    dropped: dict[str, int] = {}
    for job, ranks in per_rank.items():
        if sum(ranks.values()) <= cap:
            continue
        used = ranks.get("", 0)
        for rank in sorted((r for r in ranks if r), key=_rank_order):
            if used + ranks[rank] <= cap:
                used += ranks[rank]
            else:
                cut.add((job, rank))
                dropped[job] = dropped.get(job, 0) + ranks[rank]
    if not expired and not cut:
        return dropped
    for metric in families:
        metric.samples = [s for s in metric.samples
                          if not ((key := (s.labels.get("job_id", ""), s.labels.get("rank", ""))) in expired or key in cut)]
    return dropped


def _encode(encoder: Callable[[Any], bytes], collector: Any) -> bytes:
    """Encode one block; OpenMetrics' "# EOF" is added once, after everything."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    body = _RAW_CONTROL.sub(_visible, encoder(registry))
    return body[: -len(_EOF)] if body.endswith(_EOF) else body


class Exposition:
    """The /metrics body, encoded off the scrape path where possible.

    Each source's families are encoded into a block once per snapshot: right after the
    source publishes (``prerender``, in the source's thread, for every format a scrape
    has asked for), or at the first scrape that needs it. A scrape then joins the cached
    blocks with the small families that change at every tick (target, collector health)
    and the agent's own process_* families.
    """

    def __init__(self, view: Callable[[], StateView], cpu: CpuAccount = CPU,
                 max_series_per_job: int = MAX_SERIES_PER_JOB) -> None:
        self._view = view
        self._cpu = cpu
        self.max_series_per_job = max_series_per_job
        self._own = _own_collectors(CollectorRegistry(auto_describe=False))
        self._lock = threading.Lock()
        self._formats: dict[str, Callable[[Any], bytes]] = {}  # content type -> encoder
        # (source, type) -> (snapshot, expired ranks, bytes, job -> series left out by the cap)
        self._blocks: dict[tuple[str, str], tuple[Any, frozenset[tuple[str, str]], bytes, dict[str, int]]] = {}
        self.last_render: float | None = None  # time.monotonic() of the last scrape

    def _block(self, name: str, snapshot: Any, encoder: Callable[[Any], bytes], content_type: str,
               expired: frozenset[tuple[str, str]]) -> bytes:
        key = (name, content_type)
        with self._lock:
            cached = self._blocks.get(key)
        if cached is not None and cached[0] is snapshot and (cached[1] is expired or cached[1] == expired):
            return cached[2]
        out = Families()
        RENDERERS[name](snapshot, out)
        dropped = limit_series(out, expired, self.max_series_per_job)
        body = _encode(encoder, _Families(out))
        with self._lock:
            self._blocks[key] = (snapshot, expired, body, dropped)
        return body

    def prerender(self, name: str, snapshot: Any) -> None:
        """Encode a freshly published snapshot (called from the publishing source's thread)."""
        if name not in RENDERERS or snapshot is None:
            return
        with self._lock:
            formats = list(self._formats.items())
        tree = self._view().tree if formats else None
        for content_type, encoder in formats:
            self._block(name, snapshot, encoder, content_type, tree.expired_ranks if tree else frozenset())

    def dropped(self, content_type: str) -> dict[str, int]:
        """job_id -> series the cap left out of the last encoding of every source's block."""
        out: dict[str, int] = {}
        with self._lock:
            for (_, ctype), cached in self._blocks.items():
                if ctype == content_type:
                    for job, n in cached[3].items():
                        out[job] = out.get(job, 0) + n
        return out

    def render(self, accept: str) -> tuple[bytes, str]:
        self.last_render = time.monotonic()
        encoder, content_type = choose_encoder(accept)
        with self._lock:
            self._formats[content_type] = encoder
        view = self._view()
        head = Families()
        agent.render_build(head)
        agent.render_target(view, head)
        agent.render_health(view, head)
        agent.render_cpu(self._cpu.totals(), self._cpu.children(), head)
        expired = view.tree.expired_ranks if view.tree is not None else frozenset()
        blocks = [self._block(name, snapshot, encoder, content_type, expired)
                  for name, snapshot in sorted(view.snapshots.items()) if name in RENDERERS and snapshot is not None]
        live = set(view.tree.job_status()) if view.tree is not None else set()
        agent.render_series_dropped({j: n for j, n in self.dropped(content_type).items() if j in live}, head)
        parts = [_encode(encoder, _Families(head)), *blocks]
        own = encoder(self._own)
        own = own[: -len(_EOF)] if own.endswith(_EOF) else own
        body = own + b"".join(parts)
        if content_type.startswith("application/openmetrics-text"):
            body += _EOF
        return body, content_type

"""The /metrics body: the one render path from the latest state to the exposition.

A scrape only reads snapshots the sources already published: no /proc read, NVML call
or py-spy run happens on a scrape. Each source's families are encoded once per
snapshot, so scrapes between two source ticks cost a few dictionary lookups.
"""

from __future__ import annotations

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


def _encode(encoder: Callable[[Any], bytes], collector: Any) -> bytes:
    """Encode one block; OpenMetrics' "# EOF" is added once, after everything."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    body = encoder(registry)
    return body[: -len(_EOF)] if body.endswith(_EOF) else body


class Exposition:
    """The /metrics body, encoded off the scrape path where possible.

    Each source's families are encoded into a block once per snapshot: right after the
    source publishes (``prerender``, in the source's thread, for every format a scrape
    has asked for), or at the first scrape that needs it. A scrape then joins the cached
    blocks with the small families that change at every tick (target, collector health)
    and the agent's own process_* families.
    """

    def __init__(self, view: Callable[[], StateView], cpu: CpuAccount = CPU) -> None:
        self._view = view
        self._cpu = cpu
        self._own = _own_collectors(CollectorRegistry(auto_describe=False))
        self._lock = threading.Lock()
        self._formats: dict[str, Callable[[Any], bytes]] = {}  # content type -> encoder
        self._blocks: dict[tuple[str, str], tuple[Any, bytes]] = {}  # (source, type) -> (snapshot, bytes)
        self.last_render: float | None = None  # time.monotonic() of the last scrape

    def _block(self, name: str, snapshot: Any, encoder: Callable[[Any], bytes], content_type: str) -> bytes:
        key = (name, content_type)
        with self._lock:
            cached = self._blocks.get(key)
        if cached is not None and cached[0] is snapshot:
            return cached[1]
        out = Families()
        RENDERERS[name](snapshot, out)
        body = _encode(encoder, _Families(out))
        with self._lock:
            self._blocks[key] = (snapshot, body)
        return body

    def prerender(self, name: str, snapshot: Any) -> None:
        """Encode a freshly published snapshot (called from the publishing source's thread)."""
        if name not in RENDERERS or snapshot is None:
            return
        with self._lock:
            formats = list(self._formats.items())
        for content_type, encoder in formats:
            self._block(name, snapshot, encoder, content_type)

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
        parts = [_encode(encoder, _Families(head))]
        for name, snapshot in sorted(view.snapshots.items()):
            if name in RENDERERS and snapshot is not None:
                parts.append(self._block(name, snapshot, encoder, content_type))
        own = encoder(self._own)
        own = own[: -len(_EOF)] if own.endswith(_EOF) else own
        body = own + b"".join(parts)
        if content_type.startswith("application/openmetrics-text"):
            body += _EOF
        return body, content_type

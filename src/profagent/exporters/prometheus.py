"""Prometheus exporter: a client_python ``Collector`` that renders the latest state.

``collect()`` only reads snapshots the sources already published: no /proc read, NVML
call or py-spy run happens on a scrape. The rendered families are cached per state
version, so scrapes between two source ticks cost one dictionary lookup.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder

from profagent.agent.state import StateView
from profagent.exporters.families import Families, agent, gpu, host, ondemand, stacks
from profagent.exporters.families import traces as traces_families

Renderer = Callable[[Any, Families], None]

# source name -> how its snapshot becomes families. A new source adds one line here.
RENDERERS: dict[str, Renderer] = {
    "host": host.render,
    "gpu": gpu.render,
    "stacks": stacks.render,
    "traces": traces_families.render,
    "ondemand": ondemand.render,
}


def render_view(view: StateView, out: Families) -> None:
    agent.render_target(view, out)
    agent.render_health(view, out)
    for name, snapshot in view.snapshots.items():
        renderer = RENDERERS.get(name)
        if renderer is not None and snapshot is not None:
            renderer(snapshot, out)


class ProfagentCollector:
    """Renders every job's state view. ``views`` returns one StateView per attached job."""

    def __init__(self, views: Callable[[], Iterable[StateView]]) -> None:
        self._views = views

    def collect(self) -> Iterator[Metric]:
        out = Families()
        agent.render_build(out)
        for view in self._views():
            render_view(view, out)
        return iter(out)

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: families vary with what sources are on


def _own_collectors(registry: CollectorRegistry) -> CollectorRegistry:
    """The agent's own process_*, python_* families (they describe the agent itself)."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def build_registry(views: Callable[[], Iterable[StateView]]) -> CollectorRegistry:
    """A fresh registry (never the global one) with profagent and the agent's own process_*."""
    registry = _own_collectors(CollectorRegistry(auto_describe=False))
    registry.register(ProfagentCollector(views))
    return registry


class Exposition:
    """The /metrics body. profagent's families are encoded once per state version (and
    format), so a scrape between two source ticks costs a lookup; the agent's own
    process_* families are read fresh each time."""

    def __init__(self, views: Callable[[], Iterable[StateView]]) -> None:
        self._views = views
        self._own = _own_collectors(CollectorRegistry(auto_describe=False))
        self._profagent = CollectorRegistry(auto_describe=False)
        self._profagent.register(ProfagentCollector(self._pinned))
        self._pinned_views: list[StateView] = []
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[tuple[int, ...], bytes]] = {}

    def _pinned(self) -> list[StateView]:
        return self._pinned_views

    def render(self, accept: str) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
        views = list(self._views())
        key = tuple(v.version for v in views)
        with self._lock:
            cached = self._cache.get(content_type)
            if cached is None or cached[0] != key:
                self._pinned_views = views  # render exactly the views the key describes
                cached = self._cache[content_type] = (key, encoder(self._profagent))
        own = encoder(self._own)
        if own.endswith(b"# EOF\n"):  # OpenMetrics ends once, after everything
            own = own[: -len(b"# EOF\n")]
        return own + cached[1], content_type

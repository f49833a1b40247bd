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
        self._lock = threading.Lock()
        self._cache_key: tuple[int, ...] | None = None
        self._cache: list[Metric] = []

    def collect(self) -> Iterator[Metric]:
        views = list(self._views())
        key = tuple(v.version for v in views) + (len(views),)
        with self._lock:
            if key != self._cache_key:
                out = Families()
                agent.render_build(out)
                for view in views:
                    render_view(view, out)
                self._cache = list(out)
                self._cache_key = key
            return iter(self._cache)

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: families vary with what sources are on


def build_registry(views: Callable[[], Iterable[StateView]]) -> CollectorRegistry:
    """A fresh registry (never the global one) with profagent and the agent's own process_*."""
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    registry.register(ProfagentCollector(views))
    return registry

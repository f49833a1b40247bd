"""The agent's JSON API: every ``/api/*`` route, one module each, registered from ``ROUTES``.

``docs/openapi.yaml`` documents exactly the paths of ``ROUTES`` (a unit test holds the two
together). The engine hands the routes what they read as one ``ApiProviders``; a route
reads typed snapshots, or the narrow protocols its module names, never the engine itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from profagent.contracts import FindingsSnapshot, StateView
from profagent.exporters.api.findings import findings_route
from profagent.exporters.api.incidents import IncidentRecord, incidents_route
from profagent.exporters.api.ranks import RanksApi
from profagent.exporters.api.stacks import StacksRing, stacks_route
from profagent.exporters.api.timeline import TimelineRecorder, timeline_route
from profagent.exporters.http import Route


@dataclass(frozen=True)
class ApiProviders:
    """What the composition root (``engine/agent.py``) gives the API, each read per request."""

    node: str  # this host's name, in /api/ranks
    views: Callable[[], Sequence[StateView]]  # the state view of every job served
    watched: Callable[[], None]  # someone looks at the ranks (`top --url`): sample at the full rate
    stacks: Callable[[], Sequence[StacksRing]]  # the running stacks sources, one per job
    findings: Callable[[], Sequence[FindingsSnapshot | None]]  # per job; empty when the engine is off
    incidents: Callable[[], Sequence[IncidentRecord]]  # the incidents folder, oldest first
    job_ids: Callable[[], Iterable[str]] | None  # the jobs whose incidents are listed; None: all (watch)
    timeline: Callable[[], Sequence[TimelineRecorder]] = lambda: ()  # the running timeline sources


RouteBuilder = Callable[[ApiProviders], Route]

ROUTES: Mapping[str, RouteBuilder] = {
    "/api/findings": lambda p: findings_route(p.findings),
    "/api/incidents": lambda p: incidents_route(p.incidents, p.job_ids),
    "/api/ranks": lambda p: RanksApi(p.views, p.node, watched=p.watched).route,
    "/api/stacks": lambda p: stacks_route(p.stacks),
    "/api/timeline": lambda p: timeline_route(p.timeline, p.node),
}


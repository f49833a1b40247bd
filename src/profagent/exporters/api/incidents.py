"""GET /api/incidents: the incident bundles of this agent's jobs, listed or one in detail.

The bundles are read through ``IncidentRecord`` (what the route needs of the engine's
``BundleMeta``), so the exporters do not import the engine that captures them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import orjson

from profagent.exporters.http import Route


class IncidentRecord(Protocol):
    """One bundle as read from the incidents folder (``engine/incidents/bundle.py``)."""

    id: str
    job_id: str | None

    def listed(self) -> dict[str, Any]:
        """The keys a listing shows (id, kind, job_id, time, path, rank, reason, status)."""
        ...

    def detail(self) -> dict[str, Any]:
        """The bundle's summary (Markdown) and its files (name, bytes)."""
        ...


def incidents_route(
    bundles: Callable[[], Sequence[IncidentRecord]], jobs: Callable[[], Iterable[str]] | None = None,
) -> Route:
    """GET /api/incidents[?job=J] -> ``{"incidents": [{id, kind, job_id, time, path, rank,
    reason, status}, ...]}``, oldest first (an object, like /api/findings and /api/ranks);
    GET /api/incidents?id=ID -> that incident with its ``summary`` (Markdown) and ``files``.

    ``bundles`` lists the incidents folder, oldest first. ``jobs`` (attach mode) gives the
    job ids this agent observes: the folder is shared by every agent of the user, so only
    their bundles are listed (docs/openapi.yaml)."""

    def listed(job: str | None) -> list[IncidentRecord]:
        mine = None if jobs is None else set(jobs())
        return [m for m in bundles() if (mine is None or m.job_id in mine) and job in (None, m.job_id)]

    def route(query: dict[str, list[str]]) -> tuple[int, str, bytes]:
        wanted = (query.get("id") or [""])[0]
        job = (query.get("job") or [None])[0]
        items = listed(job)
        if not wanted:
            return 200, "application/json", orjson.dumps({"incidents": [m.listed() for m in items]})
        meta = next((m for m in items if m.id == wanted), None)
        if meta is None:
            return 404, "text/plain", f"no incident {wanted!r} of this agent's jobs\n".encode()
        return 200, "application/json", orjson.dumps({**meta.listed(), **meta.detail()})

    return route

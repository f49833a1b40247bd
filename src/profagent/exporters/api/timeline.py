"""GET /api/timeline: every rank's recent steps, as the picture (Chrome's trace event
format, which Perfetto UI opens) or as the history the CLI merges across nodes.

The route reads the timeline source through ``TimelineRecorder`` (what it needs of it).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Protocol

import orjson

from profagent.analysis.timeline_picture import chrome_trace, history_json
from profagent.contracts import TimelineHistory
from profagent.exporters.http import Route

MAX_SECONDS = 86_400.0  # the history is bounded by timeline.history_steps anyway


class TimelineRecorder(Protocol):
    """What /api/timeline reads of the timeline source (``TimelineSource``)."""

    def history(self, seconds: float, node: str = "", ranks: Collection[str] = (),
                job: str | None = None) -> TimelineHistory:
        """The steps of the last ``seconds`` of every rank (or of ``ranks``, of ``job``)."""
        ...


def timeline_route(sources: Callable[[], Sequence[TimelineRecorder]], node: str) -> Route:
    """GET /api/timeline?seconds=S&rank=R...&job=J&format=chrome|history."""

    def route(query: dict[str, list[str]]) -> tuple[int, str, bytes]:
        live = sources()
        if not live:
            return 503, "text/plain", b"the timeline source is off (see profagent_collector_up and the agent log)\n"
        try:
            seconds = float((query.get("seconds") or ["60"])[0])
        except ValueError:
            return 400, "text/plain", b"seconds=S must be a number\n"
        if not 0 < seconds <= MAX_SECONDS:
            return 400, "text/plain", f"seconds=S must be above 0 and at most {MAX_SECONDS:.0f}\n".encode()
        form = (query.get("format") or ["chrome"])[0]
        if form not in ("chrome", "history"):
            return 400, "text/plain", b"format must be chrome (the picture) or history (to merge nodes)\n"
        ranks = frozenset(query.get("rank") or ())
        job = (query.get("job") or [None])[0]
        histories = [s.history(seconds, node, ranks, job) for s in live]
        if form == "history":
            merged = TimelineHistory(node, histories[0].now, histories[0].clock_offset,
                                     tuple(r for h in histories for r in h.ranks))
            return 200, "application/json", orjson.dumps(history_json(merged))
        return 200, "application/json", orjson.dumps(chrome_trace(histories, seconds))

    return route

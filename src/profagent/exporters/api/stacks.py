"""GET /api/stacks: a rank's recent folded stacks as text, over every job's stacks source.

The route reads the stacks sources through ``StacksRing`` (what it needs of them), so this
wing stays above the sources without reaching into their state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from profagent.exporters.http import Route


class StacksRing(Protocol):
    """What /api/stacks reads of one job's stacks source (``StacksSource``)."""

    @property
    def ring_seconds(self) -> float:
        """How many seconds of stacks the ring keeps (``stacks.ring_seconds``)."""
        ...

    def ranks(self) -> list[tuple[str, str]]:
        """(job_id, rank) pairs with stacks in the ring."""
        ...

    def folded(self, rank: str, seconds: float, job_id: str | None = None) -> str:
        """Collapsed stacks of ``rank`` over the last ``seconds`` (one ``stack count`` a line)."""
        ...

    def watched(self) -> None:
        """Someone looks at this job's stacks: sample at the full rate a while."""
        ...


def stacks_route(sources: Callable[[], Sequence[StacksRing]]) -> Route:
    """The handler of GET /api/stacks over every running stacks source (one per job)."""

    def route(query: dict[str, list[str]]) -> tuple[int, str, bytes]:
        live = sources()
        if not live:
            return 503, "text/plain", b"the stacks source is off (see profagent_collector_up and the agent log)\n"
        rank = (query.get("rank") or [""])[0]
        for source in live:
            if not rank or rank in {r for _, r in source.ranks()}:
                return one_source(source, query)
        return one_source(live[0], query)

    return route


def one_source(source: StacksRing, query: dict[str, list[str]]) -> tuple[int, str, bytes]:
    """GET /api/stacks?rank=R&seconds=S[&job=J] of one source -> folded stacks as text/plain."""
    source.watched()
    keys = source.ranks()
    job = (query.get("job") or [None])[0]
    rank = (query.get("rank") or [""])[0]
    known = ", ".join(f"{r} (job {j})" if j else r for j, r in keys) or "none yet"
    if not rank:
        if len(keys) != 1:
            return 400, "text/plain", f"rank=R is required (sampled ranks: {known})\n".encode()
        job, rank = keys[0]
    try:
        seconds = float((query.get("seconds") or ["60"])[0])
    except ValueError:
        return 400, "text/plain", b"seconds=S must be a number\n"
    matches = [(j, r) for j, r in keys if r == rank and job in (None, j)]
    if not matches:
        return 404, "text/plain", f"no stacks for rank {rank} (sampled ranks: {known})\n".encode()
    if len({j for j, _ in matches}) > 1:
        return 400, "text/plain", f"rank {rank} exists in several jobs: add job=J (sampled ranks: {known})\n".encode()
    seconds = min(max(seconds, 0.0), source.ring_seconds)
    return 200, "text/plain; charset=utf-8", source.folded(rank, seconds, matches[0][0]).encode()

"""The recent folded stacks of every rank, for ``/api/stacks`` and ``profagent top``.

One ring per (job_id, rank): each finished window's folded lines with their counts, kept
``stacks.ring_seconds`` and at most ``RING_MAX_BYTES``, oldest out first. Written by the
source's collect, read by HTTP threads: one lock.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Collection, Iterable

from profagent.analysis.stacks import Sample

RING_MAX_BYTES = 4 << 20  # per rank
RING_MAX_LINES = 5000  # distinct stacks kept per window


class StackRing:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (job_id, rank) -> deque of (wall_end, {folded line: count}, bytes)
        self._ring: dict[tuple[str, str], deque[tuple[float, dict[str, int], int]]] = {}
        self._bytes: dict[tuple[str, str], int] = {}

    def add(self, key: tuple[str, str], wall_end: float, samples: Iterable[Sample], keep_seconds: float,
            prefix: str = "") -> None:
        """One window's samples of a rank (``prefix`` before each line: a worker's role);
        windows ended more than ``keep_seconds`` before it go."""
        lines: dict[str, int] = {}
        for n, s in enumerate(samples):
            if n >= RING_MAX_LINES:
                break
            line = prefix + s.folded
            lines[line] = lines.get(line, 0) + s.count
        size = sum(len(k) + 8 for k in lines)
        with self._lock:
            ring = self._ring.setdefault(key, deque())
            ring.append((wall_end, lines, size))
            total = self._bytes.get(key, 0) + size
            horizon = wall_end - keep_seconds
            while ring and (ring[0][0] < horizon or total > RING_MAX_BYTES):
                total -= ring.popleft()[2]
            self._bytes[key] = total

    def forget(self, live_jobs: set[str], expired: Collection[tuple[str, str]] = frozenset()) -> None:
        """Drop the ranks of jobs that are gone, and the (job, rank) pairs in ``expired``."""
        with self._lock:
            for key in [k for k in self._ring if k[0] not in live_jobs or k in expired]:
                del self._ring[key]
                self._bytes.pop(key, None)

    def ranks(self) -> list[tuple[str, str]]:
        """(job_id, rank) pairs with stacks in the ring."""
        with self._lock:
            return sorted(self._ring)

    def folded(self, rank: str, since: float, job_id: str | None = None) -> str:
        """Collapsed stacks of ``rank`` in windows ended at ``since`` (wall) or later, one
        ``stack count`` a line."""
        totals: dict[str, int] = {}
        with self._lock:
            windows = [lines for (job, r), ring in self._ring.items() if r == rank and job_id in (None, job)
                       for end, lines, _ in ring if end >= since]
        for lines in windows:
            for stack, n in lines.items():
                totals[stack] = totals.get(stack, 0) + n
        return "".join(f"{stack} {n}\n" for stack, n in sorted(totals.items()))

    def bytes(self, key: tuple[str, str]) -> int:
        with self._lock:
            return self._bytes.get(key, 0)

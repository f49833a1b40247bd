"""Short, bounded histories the findings need: windowed counter deltas and memory series.

Pure: every method takes the time it is given (no clock of its own).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping


class CountsWindow:
    """Cumulative counters of one series (e.g. a rank's stack samples by category);
    ``delta()`` is what they grew by over the last ``window`` seconds."""

    def __init__(self, window: float) -> None:
        self.window = window
        self.first_seen: float | None = None
        self._ring: deque[tuple[float, dict[str, int]]] = deque()

    def add(self, t: float, counts: Mapping[str, int]) -> None:
        counts = dict(counts)
        if self._ring and any(counts.get(k, 0) < v for k, v in self._ring[-1][1].items()):
            self._ring.clear()  # a counter went back (the source restarted): start over
        if self.first_seen is None:
            self.first_seen = t
        self._ring.append((t, counts))
        # Keep one entry at or before the horizon as the base of the delta.
        while len(self._ring) > 2 and self._ring[1][0] <= t - self.window:
            self._ring.popleft()

    def span(self) -> float:
        """Seconds between the base of ``delta()`` and the latest counts."""
        return self._ring[-1][0] - self._ring[0][0] if len(self._ring) > 1 else 0.0

    def delta(self) -> dict[str, int]:
        if len(self._ring) < 2:
            return {}
        (_, old), (_, new) = self._ring[0], self._ring[-1]
        return {k: v - old.get(k, 0) for k, v in new.items() if v - old.get(k, 0) > 0}


class MemorySeries:
    """(t, bytes) readings of one memory series over the last ``window`` seconds, with a
    least-squares growth rate."""

    def __init__(self, window: float, max_points: int = 600) -> None:
        self.window = window
        self._points: deque[tuple[float, float]] = deque(maxlen=max_points)

    def add(self, t: float, value: float) -> None:
        self._points.append((t, float(value)))
        while self._points and self._points[0][0] < t - self.window:
            self._points.popleft()

    @property
    def span(self) -> float:
        return self._points[-1][0] - self._points[0][0] if len(self._points) > 1 else 0.0

    @property
    def last_time(self) -> float | None:
        return self._points[-1][0] if self._points else None

    @property
    def last(self) -> float | None:
        return self._points[-1][1] if self._points else None

    def __len__(self) -> int:
        return len(self._points)

    def fit(self, since: float | None = None) -> tuple[float, float] | None:
        """(slope in bytes per second, r squared) of the readings at or after ``since``
        (all by default), or None with fewer than 3 points."""
        points = [p for p in self._points if since is None or p[0] >= since]
        n = len(points)
        if n < 3:
            return None
        mt = sum(t for t, _ in points) / n
        mv = sum(v for _, v in points) / n
        stt = sum((t - mt) ** 2 for t, _ in points)
        svv = sum((v - mv) ** 2 for _, v in points)
        stv = sum((t - mt) * (v - mv) for t, v in points)
        if stt <= 0:
            return None
        slope = stv / stt
        r2 = (stv * stv) / (stt * svv) if svv > 0 else 0.0
        return slope, r2

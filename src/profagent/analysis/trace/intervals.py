"""Interval arithmetic with numpy: unions, and one shared grid to intersect them on.

``merge`` turns possibly overlapping [start, end) spans into a sorted disjoint union.
A ``Timeline`` is the grid of every boundary of a set of unions: on it, each union is a
boolean mask over elementary segments, so intersections, differences and priorities are
``&``, ``& ~`` and running "not yet claimed" masks, and times are masked sums.
"""

from __future__ import annotations

import numpy as np

Merged = tuple[np.ndarray, np.ndarray]  # (starts, ends), sorted and disjoint


def unique(values: np.ndarray) -> np.ndarray:
    """Sorted distinct values, like ``np.unique`` without its first-call import of
    ``numpy.ma`` (a tenth of numpy's import time, paid by every `profagent analyze`).
    NaNs are not expected here (the reader keeps finite timestamps)."""
    s = np.sort(values)
    if len(s) < 2:
        return s
    keep = np.empty(len(s), dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def merge(starts: np.ndarray, ends: np.ndarray) -> Merged:
    """Union of spans; empty and negative spans are dropped."""
    keep = ends > starts
    s, e = starts[keep], ends[keep]
    if len(s) == 0:
        return np.empty(0), np.empty(0)
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    np.greater(s[1:], reach[:-1], out=new[1:])
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(s) - 1)
    return s[first], reach[last]


def total(m: Merged) -> float:
    return float((m[1] - m[0]).sum())


def covered(m: Merged, points: np.ndarray) -> np.ndarray:
    """For each point, whether it lies inside the union (start inclusive, end exclusive)."""
    if len(m[0]) == 0:
        return np.zeros(len(points), dtype=bool)
    i = np.searchsorted(m[0], points, side="right") - 1
    ok = i >= 0
    out = np.zeros(len(points), dtype=bool)
    out[ok] = points[ok] < m[1][i[ok]]
    return out


class Timeline:
    """Elementary segments between every boundary of the given unions."""

    def __init__(self, unions: list[Merged]) -> None:
        pts = unique(np.concatenate([np.concatenate(m) for m in unions] or [np.empty(0)]))
        self.points = pts
        self.left = pts[:-1]
        self.length = np.diff(pts)

    def mask(self, m: Merged) -> np.ndarray:
        """Segments inside ``m`` (a union from ``merge``)."""
        pts = self.points
        i, j = np.searchsorted(pts, m[0]), np.searchsorted(pts, m[1])
        if len(j) == 0 or j[-1] >= len(pts) or (pts[i] != m[0]).any() or (pts[j] != m[1]).any():
            return covered(m, self.left)  # not one of the grid's unions
        # m's boundaries are grid points: +1 where a span starts, -1 where it ends, and a
        # running sum (spans are disjoint, so 0 or 1). Cheaper than locating every segment.
        edge = np.zeros(len(pts), dtype=np.int8)
        edge[i] = 1
        edge[j] = -1
        return np.cumsum(edge[:-1], dtype=np.int8).astype(bool)

    def time(self, mask: np.ndarray) -> float:
        return float(self.length[mask].sum())

    def runs(self, mask: np.ndarray) -> Merged:
        """The mask's maximal runs as spans."""
        if len(mask) == 0:
            return np.empty(0), np.empty(0)
        edge = np.diff(mask.astype(np.int8), prepend=0, append=0)
        starts = np.flatnonzero(edge == 1)
        ends = np.flatnonzero(edge == -1)
        return self.points[starts], self.points[ends]

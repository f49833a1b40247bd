"""How state becomes metric families: one module per source, plus the agent's own.

Each module has ``render(snapshot, out: Families)``; it reads an immutable snapshot and
adds samples. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)


class Families:
    """Accumulates families by name, so several jobs (watch mode) share one family."""

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}

    def gauge(self, name: str, documentation: str, labels: Sequence[str], unit: str = "") -> GaugeMetricFamily:
        fam = self._families.get(name)
        if fam is None:
            fam = self._families[name] = GaugeMetricFamily(name, documentation, labels=labels, unit=unit)
        return fam  # type: ignore[return-value]

    def counter(self, name: str, documentation: str, labels: Sequence[str], unit: str = "") -> CounterMetricFamily:
        """``name`` without the ``_total`` suffix; the client library adds it."""
        fam = self._families.get(name)
        if fam is None:
            fam = self._families[name] = CounterMetricFamily(name, documentation, labels=labels, unit=unit)
        return fam  # type: ignore[return-value]

    def histogram(self, name: str, documentation: str, labels: Sequence[str]) -> HistogramMetricFamily:
        fam = self._families.get(name)
        if fam is None:
            fam = self._families[name] = HistogramMetricFamily(name, documentation, labels=labels)
        return fam  # type: ignore[return-value]

    def info(self, name: str, documentation: str, labels: Sequence[str]) -> InfoMetricFamily:
        fam = self._families.get(name)
        if fam is None:
            fam = self._families[name] = InfoMetricFamily(name, documentation, labels=labels)
        return fam  # type: ignore[return-value]

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())

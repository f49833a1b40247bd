"""How state becomes metric families: one module per source, plus the agent's own.

Each module has ``render(snapshot, out: Families)``; it reads an immutable snapshot and
adds samples. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

_M = TypeVar("_M", bound=Metric)


class DuplicateFamily(ValueError):
    """A name registered twice with another type, help, labels or unit: one would hide the other."""


class Families:
    """Accumulates families by name, so several jobs (watch mode) share one family.

    Asking again for a name with the same type, help, labels and unit returns the family
    already there; anything else raises ``DuplicateFamily`` (as client_python's registry
    does), because one of the two would silently lose its samples or its meaning.
    """

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}
        self._specs: dict[str, tuple[type[Metric], str, tuple[str, ...], str]] = {}

    def _get(self, cls: type[_M], name: str, documentation: str, labels: Sequence[str], unit: str = "") -> _M:
        spec = (cls, documentation, tuple(labels), unit)
        known = self._specs.get(name)
        if known is None:
            fam = cls(name, documentation, labels=labels, unit=unit) if unit else cls(name, documentation, labels=labels)
            self._families[name], self._specs[name] = fam, spec
            return fam
        if known != spec:
            raise DuplicateFamily(f"metric family {name!r} registered twice: {_describe(known)} and {_describe(spec)}")
        fam = self._families[name]
        assert isinstance(fam, cls)
        return fam

    def gauge(self, name: str, documentation: str, labels: Sequence[str], unit: str = "") -> GaugeMetricFamily:
        return self._get(GaugeMetricFamily, name, documentation, labels, unit)

    def counter(self, name: str, documentation: str, labels: Sequence[str], unit: str = "") -> CounterMetricFamily:
        """``name`` without the ``_total`` suffix; the client library adds it."""
        return self._get(CounterMetricFamily, name, documentation, labels, unit)

    def histogram(self, name: str, documentation: str, labels: Sequence[str]) -> HistogramMetricFamily:
        return self._get(HistogramMetricFamily, name, documentation, labels)

    def info(self, name: str, documentation: str, labels: Sequence[str]) -> InfoMetricFamily:
        return self._get(InfoMetricFamily, name, documentation, labels)

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


def _describe(spec: tuple[type[Metric], str, tuple[str, ...], str]) -> str:
    cls, documentation, labels, unit = spec
    return f"{cls.__name__}(help={documentation!r}, labels={list(labels)}, unit={unit!r})"

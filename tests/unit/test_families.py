"""Families: a name asked for again returns its family; a name registered with another
type, help, labels or unit raises (as client_python's registry does) instead of hiding
one of the two; and the full exposition names every family once."""

from __future__ import annotations

import pytest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from profagent.exporters.families import DuplicateFamily, Families


def test_the_same_name_asked_again_is_the_same_family() -> None:
    """Watch mode: several jobs add samples to one family."""
    out = Families()
    first = out.gauge("profagent_x", "doc", ("job",))
    first.add_metric(["a"], 1)
    again = out.gauge("profagent_x", "doc", ["job"])
    again.add_metric(["b"], 2)
    assert again is first
    [family] = list(out)
    assert isinstance(family, GaugeMetricFamily)
    assert [s.labels["job"] for s in family.samples] == ["a", "b"]


@pytest.mark.parametrize(("second", "clash"), [
    (lambda out: out.counter("profagent_x", "doc", ("job",)), "CounterMetricFamily"),
    (lambda out: out.gauge("profagent_x", "other doc", ("job",)), "other doc"),
    (lambda out: out.gauge("profagent_x", "doc", ("job", "rank")), "'rank'"),
    (lambda out: out.gauge("profagent_x", "doc", ("job",), unit="seconds"), "'seconds'"),
    (lambda out: out.histogram("profagent_x", "doc", ("job",)), "HistogramMetricFamily"),
    (lambda out: out.info("profagent_x", "doc", ("job",)), "InfoMetricFamily"),
])
def test_a_name_registered_twice_otherwise_raises_naming_both(second, clash: str) -> None:
    out = Families()
    out.gauge("profagent_x", "doc", ("job",)).add_metric(["a"], 1)
    with pytest.raises(DuplicateFamily, match="profagent_x") as raised:
        second(out)
    assert "GaugeMetricFamily" in str(raised.value) and clash in str(raised.value)
    [family] = list(out)  # the first family stays, with its samples
    assert isinstance(family, GaugeMetricFamily) and len(family.samples) == 1


def test_a_counter_asked_again_with_its_unit_is_the_same_family() -> None:
    out = Families()
    first = out.counter("profagent_y", "doc", ("job",), unit="seconds")
    assert out.counter("profagent_y", "doc", ("job",), unit="seconds") is first
    assert isinstance(first, CounterMetricFamily)


def test_the_full_exposition_names_every_family_once() -> None:
    """Each source's block is rendered into its own Families, so a name two sources share
    would only show here: the golden state covers every source."""
    from test_exposition_golden import render  # the golden state of every source (rootdir import)

    from profagent.exporters.exposition import choose_encoder

    _, content_type = choose_encoder("text/plain")
    types = [line.split()[2] for line in render(content_type).splitlines() if line.startswith("# TYPE ")]
    assert len(types) > 100
    assert sorted(types) == sorted(set(types))

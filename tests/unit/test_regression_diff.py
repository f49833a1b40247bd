"""Live, the same answer: the step-time regression names the top contributors of the same
diff as `profagent diff`, against the rank's first steady traces or `traces.baseline`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from helpers.paths import shared_traces
from profagent.analysis.incidents import CONTRIBUTORS, RegressionDetector
from profagent.analysis.trace.report import analyze
from profagent.cli.diff import diff_paths
from profagent.sources.traces.reader import read_trace
from profagent.sources.traces.source import TracesSource
from unit.test_traces_diff import _load, _stretch, _top_kernel_in_steps, _write
from unit.test_traces_source import TREE

SMALL = shared_traces() / "small-gpu-rank0.pt.trace.json.gz"


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small trace with its largest compute kernel made 2x longer (test_traces_diff)."""
    data = _load(SMALL)
    return _write(tmp_path_factory.mktemp("slow") / "slow.pt.trace.json.gz", _stretch(data, _top_kernel_in_steps(data)))


def _report(path: Path):  # noqa: ANN202
    return analyze(read_trace(path), in_steps=True)


def test_regression_names_the_diff_contributors_from_the_first_steady_traces(slow: Path) -> None:
    base, bad = _report(SMALL), _report(slow)
    det = RegressionDetector(factor=1.001, seconds=0.0)
    for i in range(3):  # three steady traces: the baseline, and the side diffed against
        det.observe("j", "0", base.step_mean, at=float(i), report=base)
    det.observe("j", "0", bad.step_mean, at=10.0, report=bad)
    [t] = det.triggers(10.0)
    cli = diff_paths(SMALL, slow).to_dict()  # what `profagent diff` says of the same pair
    cli_deltas = {(c["kind"], c["name"]): c["delta"] for c in cli["contributors"]}
    named = t.evidence["contributors"]
    assert len(named) == CONTRIBUTORS
    for c in named:  # the same rows (names of 120+ characters shortened), ties in any order
        full = next(k for k in cli_deltas if k[0] == c["kind"] and (k[1] == c["name"] or k[1][:119] + "…" == c["name"]))
        assert c["delta"] == pytest.approx(cli_deltas[full], rel=1e-9, abs=1e-15)
    assert [abs(c["delta"]) for c in named] == pytest.approx(
        [abs(c["delta"]) for c in cli["contributors"][:CONTRIBUTORS]], rel=1e-9, abs=1e-15)
    assert t.evidence["verdict"] == cli["verdict"]
    assert cli["verdict"] in t.reason
    assert t.evidence["baseline"] == "first steady traces"
    json.dumps(t.evidence)  # the bundle summary prints the evidence as JSON


def test_configured_baseline_is_used_from_the_first_trace(slow: Path) -> None:
    base, bad = _report(SMALL), _report(slow)
    det = RegressionDetector(factor=1.001, seconds=0.0)
    det.set_baseline((base,))
    assert det.baseline("j", "3") == pytest.approx(base.step_mean)
    det.observe("j", "3", bad.step_mean, at=1.0, report=bad)  # no warm-up needed
    [t] = det.triggers(1.0)
    assert t.rank == "3" and t.evidence["baseline"] == "traces.baseline"
    assert t.evidence["verdict"] == diff_paths(SMALL, slow).to_dict()["verdict"]


def test_source_reads_traces_baseline(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "watched"
    folder.mkdir()
    source = TracesSource([folder], tmp_path / "state", baseline=str(SMALL))
    source.start()
    try:
        [report] = source.collect(TREE).baseline
        assert report.step_mean == pytest.approx(_report(SMALL).step_mean) and report.in_steps is not None
    finally:
        source.stop()
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    source = TracesSource([folder], tmp_path / "state2", baseline=str(broken))
    with caplog.at_level(logging.WARNING):
        source.start()
    try:
        assert source.collect(TREE).baseline == ()
        assert any("traces.baseline" in r.getMessage() and "is not used" in r.getMessage() for r in caplog.records)
    finally:
        source.stop()


"""Events with a missing, null, negative or non-finite ``dur`` are left out, counted and said.

Each case damages a shared real trace, then checks profagent's figures against a brute
force over the JSON the test filters itself (plain Python: it drops the damaged events and
hands the rest to the reference of test_traces_gpu.py, which shares no code with profagent).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from helpers.paths import shared_traces
from profagent.analysis.trace.report import analyze, readings
from profagent.sources.traces.reader import read_trace
from unit.test_traces_gpu import Reference

SOURCE = "small-gpu-rank0"


def _events() -> dict:
    with gzip.open(shared_traces() / f"{SOURCE}.pt.trace.json.gz", "rt") as fh:
        return json.load(fh)


def _write(path: Path, data: dict) -> Path:
    with gzip.open(path, "wt") as fh:
        json.dump(data, fh)
    return path


def _kernels(data: dict) -> list[dict]:
    return [e for e in data["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"]


def _idle_reference(path: Path) -> float:
    ref = Reference(path)
    window = ref.time(np.ones_like(ref.window))
    return 1 - ref.time(ref.cover("gpu")) / window


def test_missing_dur_is_left_out_and_said(tmp_path: Path) -> None:
    data = _events()
    damaged = _kernels(data)[::2]  # every other kernel loses its duration
    for e in damaged:
        del e["dur"]
    broken = _write(tmp_path / "broken.json.gz", data)
    data["traceEvents"] = [e for e in data["traceEvents"] if not (e.get("ph") == "X" and "dur" not in e)]
    truth = _write(tmp_path / "truth.json.gz", data)

    report = analyze(read_trace(broken))
    assert report.events_dropped == {"missing": len(damaged)}
    assert report.gpu.idle_ratio == pytest.approx(_idle_reference(truth), abs=1e-9)
    said = [w for w in report.warnings if "left out for a bad duration" in w]
    assert len(said) == 1 and f"{len(damaged)} without dur" in said[0]
    assert said[0] in readings(report)


def test_null_and_non_finite_dur_on_the_generic_decoder(tmp_path: Path) -> None:
    data = _events()
    kernels = _kernels(data)
    kernels[0]["dur"] = None
    # JSON has no infinity (msgspec refuses 1e999): an end past float's range is the case
    kernels[1]["ts"] = kernels[1]["dur"] = 1e308
    data["traceEvents"].append({"ph": "Q", "name": "an unknown phase"})  # forces the generic Event
    broken = _write(tmp_path / "broken.json.gz", data)
    report = analyze(read_trace(broken))
    assert report.events_dropped == {"missing": 1, "non_finite": 1}
    assert any("1 with a non-finite dur" in w and "1 without dur" in w for w in report.warnings)


def test_negative_dur_does_not_reduce_top_kernels(tmp_path: Path) -> None:
    data = _events()
    kernels = _kernels(data)
    totals: dict[str, float] = {}
    for e in kernels:
        totals[e["name"]] = totals.get(e["name"], 0.0) + e["dur"]
    top = max(totals, key=totals.__getitem__)
    victims = [e for e in kernels if e["name"] == top][:3]
    for e in victims:
        e["dur"] = -e["dur"]
    broken = _write(tmp_path / "broken.json.gz", data)

    expected = sum(e["dur"] for e in kernels if e["name"] == top and e["dur"] >= 0)
    report = analyze(read_trace(broken), top_k=1000)
    got = {name: seconds for name, seconds, _ in report.top_kernels}
    assert got[top] == pytest.approx(expected * 1e-6, rel=1e-12)
    counts = {name: count for name, _, count in report.top_kernels}
    assert counts[top] == sum(1 for e in kernels if e["name"] == top) - len(victims)
    assert report.events_dropped == {"negative": len(victims)}
    assert any(f"{len(victims)} with a negative dur" in w for w in report.warnings)


def test_clean_trace_has_no_dropped_events() -> None:
    report = analyze(read_trace(shared_traces() / f"{SOURCE}.pt.trace.json.gz"))
    assert report.events_dropped == {}
    assert not any("bad duration" in w for w in report.warnings)

"""Steps, accelerators and odd step patterns, on real traces (some rewritten in tmp_path),
each checked against a brute force written here: plain Python over the JSON events."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from conftest import SHARED_TRACES
from profagent.analysis.trace.report import analyze, findings
from profagent.sources.traces.reader import read_trace

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "mtia_ccp_events"}


def _events(path: Path) -> dict:
    with gzip.open(path, "rt") as fh:
        return json.load(fh)


def _write(tmp_path: Path, data: dict, name: str = "t.pt.trace.json") -> Path:
    out = tmp_path / name
    out.write_text(json.dumps(data))
    return out


def brute_steps(data: dict) -> tuple[list[float], list[float]]:
    """(complete step durations, incomplete) in µs: ProfilerStep CPU ranges by start, an
    exact or nested repeat skipped; the last one incomplete when every earlier step holds
    an ``Optimizer.step#`` range and it does not, or (no such ranges) when shorter than
    half the shortest earlier step."""
    xs = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    ranges = sorted(((e["ts"], e["ts"] + e["dur"]) for e in xs if e.get("cat") in ("user_annotation", "cpu_op")
                     and e.get("name", "").startswith("ProfilerStep#")), key=lambda r: (r[0], -r[1]))
    kept: list[tuple[float, float]] = []
    for s, e in ranges:
        if e > s and not (kept and e <= kept[-1][1]):
            kept.append((max(s, kept[-1][1]) if kept else s, e))
    durations = [e - s for s, e in kept]
    if len(kept) < 2:
        return durations, []
    marks = [e["ts"] for e in xs if e.get("cat") in ("user_annotation", "cpu_op")
             and e.get("name", "").startswith("Optimizer.step#")]
    has = [any(s <= m < e for m in marks) for s, e in kept]
    if all(has[:-1]):
        stub = not has[-1]
    else:
        stub = durations[-1] < min(durations[:-1]) / 2
    return (durations[:-1], durations[-1:]) if stub else (durations, [])


def brute_union(spans: list[tuple[float, float]], windows: list[tuple[float, float]]) -> float:
    """µs covered by ``spans`` inside ``windows`` (plain sort-and-sweep)."""
    total = 0.0
    for ws, we in windows:
        clipped = sorted((max(s, ws), min(e, we)) for s, e in spans if min(e, we) > max(s, ws))
        reach = float("-inf")
        for s, e in clipped:
            if e > reach:
                total += e - max(s, reach)
                reach = e
    return total


def test_a100_80gb_steady_steps_are_equal() -> None:
    path = SHARED_TRACES / "a100-80gb-rank0.pt.trace.json.gz"
    expected, incomplete = brute_steps(_events(path))
    report = analyze(read_trace(path))
    assert [s.seconds for s in report.steps] == pytest.approx([d * 1e-6 for d in expected], abs=1e-9)
    assert incomplete == [] and report.steps_incomplete == ()
    assert report.step_mean == pytest.approx(0.2148, abs=1e-4)  # was 0.2465 with step 1 = 371.6 ms
    assert max(s.seconds for s in report.steps) < 1.05 * report.step_mean
    assert not any("slowest step" in f for f in findings(report))
    assert report.gpu_lag is not None and report.gpu_lag > 0.1  # the ~158 ms lag, reported apart
    assert report.accelerator == "cuda"


def test_mi250_partial_last_step_is_excluded_and_said() -> None:
    path = SHARED_TRACES / "mi250-rocm.pt.trace.json.gz"
    expected, incomplete = brute_steps(_events(path))
    report = analyze(read_trace(path))
    assert len(expected) == 1 and len(incomplete) == 1
    assert report.step_mean == pytest.approx(expected[0] * 1e-6, abs=1e-9)
    assert report.step_mean == pytest.approx(9.29e-3, abs=1e-5)
    assert [(n, pytest.approx(s)) for n, s in report.steps_incomplete] == [("ProfilerStep#2", incomplete[0] * 1e-6)]
    assert any("ProfilerStep#2" in f and "incomplete" in f for f in findings(report))
    assert report.accelerator == "rocm"


def _renamed(data: dict, mapping: dict[str, str]) -> dict:
    out = json.loads(json.dumps(data))
    for e in out["traceEvents"]:
        if e.get("cat") in mapping:
            e["cat"] = mapping[e["cat"]]
    return out


@pytest.mark.parametrize(("accelerator", "mapping"), [
    ("mtia", {"kernel": "mtia_ccp_events", "gpu_memcpy": "mtia_ccp_events", "gpu_memset": "mtia_ccp_events",
              "cuda_runtime": "mtia_runtime"}),
    ("xpu", {"cuda_runtime": "xpu_runtime"}),
])
def test_other_accelerators_on_a_renamed_real_trace(tmp_path: Path, accelerator: str, mapping: dict) -> None:
    data = _renamed(_events(SHARED_TRACES / "small-gpu-rank0.pt.trace.json.gz"), mapping)
    report = analyze(read_trace(_write(tmp_path, data)))
    xs = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    steps, _ = brute_steps(data)
    starts = sorted(e["ts"] for e in xs if e.get("name", "").startswith("ProfilerStep#"))
    windows = [(s, s + d) for s, d in zip(starts, steps, strict=False)]
    window = sum(we - ws for ws, we in windows)
    device = [(e["ts"], e["ts"] + e["dur"]) for e in xs if e["cat"] in DEVICE_CATS]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in xs if e["cat"] in DEVICE_CATS
               and (accelerator == "mtia" or e["cat"] == "kernel")]
    runtime_cat = "mtia_runtime" if accelerator == "mtia" else "xpu_runtime"
    launch = {e["args"]["correlation"]: e["ts"] for e in xs if e["cat"] == runtime_cat}
    delays = sorted(max(0.0, e["ts"] - launch[e["args"]["correlation"]]) for e in xs
                    if e["cat"] in ({"mtia_ccp_events"} if accelerator == "mtia" else {"kernel"})
                    and e.get("args", {}).get("correlation") in launch)
    assert report.accelerator == accelerator
    assert report.gpu is not None
    assert report.gpu.idle_ratio == pytest.approx(1 - brute_union(device, windows) / window, abs=1e-9)
    assert report.gpu.utilization == pytest.approx(brute_union(kernels, windows) / window, abs=1e-9)
    assert report.breakdown["runtime"] > 0
    assert report.launch_delay["max"] == pytest.approx(delays[-1] * 1e-6)
    assert not any("no accelerator activity" in f for f in findings(report))


def _with_steps(tmp_path: Path, steps: list[tuple[str, float, float]]) -> tuple[dict, Path]:
    """small-gpu-rank0 with its ProfilerStep ranges replaced by ``steps`` (name, ts, dur)."""
    data = _events(SHARED_TRACES / "small-gpu-rank0.pt.trace.json.gz")
    template = next(e for e in data["traceEvents"] if e.get("name", "").startswith("ProfilerStep#"))
    data["traceEvents"] = [e for e in data["traceEvents"] if not e.get("name", "").startswith("ProfilerStep#")]
    for name, ts, dur in steps:
        data["traceEvents"].append({**template, "name": name, "ts": ts, "dur": dur})
    return data, _write(tmp_path, data)


T0 = 1682725898079292.0


def test_duplicate_names_both_kept_and_nested_step_is_not_a_step(tmp_path: Path) -> None:
    data, path = _with_steps(tmp_path, [
        ("ProfilerStep#7", T0, 600_000.0), ("ProfilerStep#7", T0 + 600_000, 600_000.0),  # same name twice
        ("ProfilerStep#8", T0 + 100_000, 50_000.0),  # nested in the first
    ])
    expected, _ = brute_steps(data)
    report = analyze(read_trace(path))
    assert expected == [600_000.0, 600_000.0]
    assert [s.name for s in report.steps] == ["ProfilerStep#7", "ProfilerStep#7"]
    assert [s.seconds for s in report.steps] == pytest.approx([0.6, 0.6])
    assert sum(report.breakdown.values()) == pytest.approx(1.0)


def test_zero_and_negative_steps_keep_breakdown_summing_to_one(tmp_path: Path) -> None:
    data, path = _with_steps(tmp_path, [
        ("ProfilerStep#1", T0, 600_000.0), ("ProfilerStep#2", T0 + 600_000, 0.0),
        ("ProfilerStep#3", T0 + 700_000, -5.0), ("ProfilerStep#4", T0 + 700_000, 500_000.0),
    ])
    expected, _ = brute_steps(data)
    report = analyze(read_trace(path))
    assert [s.seconds for s in report.steps] == pytest.approx([d * 1e-6 for d in expected])
    assert report.steps_dropped == 2
    assert sum(report.breakdown.values()) == pytest.approx(1.0)
    for step in report.steps:
        assert sum(step.breakdown.values()) == pytest.approx(step.seconds)
    assert any("zero or negative" in w for w in report.warnings)


def test_huge_timestamps_are_warned_about(tmp_path: Path) -> None:
    data = _events(SHARED_TRACES / "mi250-rocm.pt.trace.json.gz")
    for e in data["traceEvents"]:
        if "ts" in e:
            e["ts"] = e["ts"] + 1e29
    report = analyze(read_trace(_write(tmp_path, data)))
    assert any("1e+29" in w and "imprecise" in w for w in report.warnings)
    assert report.warnings[0] in findings(report)
    # the unmodified trace has no such warning
    assert analyze(read_trace(SHARED_TRACES / "mi250-rocm.pt.trace.json.gz")).warnings == ()


def test_cuda_sync_on_gpu_rows_is_not_cpu_runtime(tmp_path: Path) -> None:
    path = SHARED_TRACES / "a100-alexnet-cudasync.pt.trace.json.gz"
    data = _events(path)
    xs = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    device_pids = {e["pid"] for e in xs if e["cat"] in DEVICE_CATS}
    syncs = [e for e in xs if e["cat"] == "cuda_sync"]
    assert syncs and all(e["pid"] in device_pids for e in syncs)  # this trace writes them on GPU rows
    # without the sync events the figures are the same: they never counted as runtime
    stripped = dict(data, traceEvents=[e for e in data["traceEvents"] if e.get("cat") != "cuda_sync"])
    with_sync = analyze(read_trace(path))
    without = analyze(read_trace(_write(tmp_path, stripped)))
    assert with_sync.breakdown == pytest.approx(without.breakdown, abs=1e-12)
    assert with_sync.cpu_seconds == pytest.approx(without.cpu_seconds, abs=1e-12)

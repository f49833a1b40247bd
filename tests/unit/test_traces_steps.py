"""Steps, accelerators and odd step patterns, on real traces (some rewritten in tmp_path),
each checked against a brute force written here: plain Python over the JSON events."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.paths import shared_traces
from profagent.analysis.trace.report import analyze, readings
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
    path = shared_traces() / "a100-80gb-rank0.pt.trace.json.gz"
    expected, incomplete = brute_steps(_events(path))
    report = analyze(read_trace(path))
    assert [s.seconds for s in report.steps] == pytest.approx([d * 1e-6 for d in expected], abs=1e-9)
    assert incomplete == [] and report.steps_incomplete == ()
    assert report.step_mean == pytest.approx(0.2148, abs=1e-4)  # was 0.2465 with step 1 = 371.6 ms
    assert max(s.seconds for s in report.steps) < 1.05 * report.step_mean
    assert not any("slowest step" in f for f in readings(report))
    assert report.gpu_lag is not None and report.gpu_lag > 0.1  # the ~158 ms lag, reported apart
    assert report.accelerator == "cuda"


def test_mi250_partial_last_step_is_excluded_and_said() -> None:
    path = shared_traces() / "mi250-rocm.pt.trace.json.gz"
    expected, incomplete = brute_steps(_events(path))
    report = analyze(read_trace(path))
    assert len(expected) == 1 and len(incomplete) == 1
    assert report.step_mean == pytest.approx(expected[0] * 1e-6, abs=1e-9)
    assert report.step_mean == pytest.approx(9.29e-3, abs=1e-5)
    assert [(n, pytest.approx(s)) for n, s in report.steps_incomplete] == [("ProfilerStep#2", incomplete[0] * 1e-6)]
    assert any("ProfilerStep#2" in f and "incomplete" in f for f in readings(report))
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
    data = _renamed(_events(shared_traces() / "small-gpu-rank0.pt.trace.json.gz"), mapping)
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
    assert not any("no accelerator activity" in f for f in readings(report))


def _with_steps(tmp_path: Path, steps: list[tuple[str, float, float]]) -> tuple[dict, Path]:
    """small-gpu-rank0 with its ProfilerStep ranges replaced by ``steps`` (name, ts, dur)."""
    data = _events(shared_traces() / "small-gpu-rank0.pt.trace.json.gz")
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
    assert report.steps_dropped == 1  # the zero-length one; the negative one is left out by the reader
    assert report.events_dropped == {"negative": 1}
    assert sum(report.breakdown.values()) == pytest.approx(1.0)
    for step in report.steps:
        assert sum(step.breakdown.values()) == pytest.approx(step.seconds)
    assert any("zero or negative" in w for w in report.warnings)


def test_huge_timestamps_are_warned_about(tmp_path: Path) -> None:
    data = _events(shared_traces() / "mi250-rocm.pt.trace.json.gz")
    for e in data["traceEvents"]:
        if "ts" in e:
            e["ts"] = e["ts"] + 1e29
    report = analyze(read_trace(_write(tmp_path, data)))
    assert any("1e+29" in w and "imprecise" in w for w in report.warnings)
    assert report.warnings[0] in readings(report)
    # the unmodified trace has no such warning
    assert analyze(read_trace(shared_traces() / "mi250-rocm.pt.trace.json.gz")).warnings == ()


def test_cuda_sync_on_gpu_rows_is_not_cpu_runtime(tmp_path: Path) -> None:
    path = shared_traces() / "a100-alexnet-cudasync.pt.trace.json.gz"
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


def test_on_demand_trace_steps_come_from_optimizer_steps(tmp_path: Path) -> None:
    """An on-demand (daemon) trace has no ProfilerStep; torch's Optimizer.step ranges mark
    the iterations, so the step time is one iteration, not the whole window."""
    data = _events(shared_traces() / "a100-80gb-rank0.pt.trace.json.gz")
    data["traceEvents"] = [e for e in data["traceEvents"] if not e.get("name", "").startswith("ProfilerStep#")]
    marks = sorted({e["ts"] for e in data["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                    and e["name"] == "Optimizer.step#FusedAdam.step"})
    expected = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    report = analyze(read_trace(_write(tmp_path, data)))
    assert report.step_source == "optimizer" and not report.steps_inferred
    assert [s.seconds for s in report.steps] == pytest.approx([d * 1e-6 for d in expected], abs=1e-9)
    assert len(report.steps) == 4 and report.step_mean == pytest.approx(0.2148, abs=2e-3)
    # without optimizer ranges either, the window is no step time (flagged as inferred)
    data["traceEvents"] = [e for e in data["traceEvents"] if not e.get("name", "").startswith("Optimizer.step#")]
    bare = analyze(read_trace(_write(tmp_path, data, "bare.pt.trace.json")))
    assert bare.steps_inferred and bare.step_source == "window"


def test_step_seconds_only_from_real_steps(tmp_path: Path) -> None:
    from profagent.contracts import RankTrace, TracesSnapshot
    from profagent.exporters.families import Families
    from profagent.exporters.families.traces import render

    data = _events(shared_traces() / "mi250-rocm.pt.trace.json.gz")
    data["traceEvents"] = [e for e in data["traceEvents"]
                           if not e.get("name", "").startswith(("ProfilerStep#", "Optimizer.step#"))]
    window_only = analyze(read_trace(_write(tmp_path, data)))
    stepped = analyze(read_trace(shared_traces() / "mi250-rocm.pt.trace.json.gz"))
    snap = TracesSnapshot("job", (RankTrace("0", window_only, 1.0, "job"), RankTrace("1", stepped, 1.0, "job")), (), 0)
    out = Families()
    render(snap, out)
    samples = {f.name: [(s.labels, s.value) for s in f.samples] for f in out}
    assert [(labels["rank"], v) for labels, v in samples["profagent_trace_step_seconds"]] == [
        ("1", pytest.approx(9.288291e-3))]
    assert ({"job_id": "job", "rank": "1", "accelerator": "rocm"}, 1) in samples["profagent_trace_info"]
    assert ({"job_id": "job", "rank": "1"}, 1) in samples["profagent_trace_steps_incomplete"]


def _run_analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profagent", "analyze", *args],
                          capture_output=True, text=True, timeout=120)


def test_analyze_folder_ends_with_a_cross_rank_summary(tmp_path: Path) -> None:
    data = _events(shared_traces() / "mi250-rocm.pt.trace.json.gz")
    folder = tmp_path / "job"
    (folder / "node1").mkdir(parents=True)
    expected = {}
    for rank, scale in ((0, 1.0), (1, 1.0), (2, 1.5), (3, 1.1)):
        copy = json.loads(json.dumps(data))
        for e in copy["traceEvents"]:
            if e.get("name") == "ProfilerStep#1" and e.get("cat") == "user_annotation":
                e["dur"] *= scale
        sub = folder / "node1" if rank >= 2 else folder
        _write(sub, copy, f"trace_rank{rank}.json")
        steps, _ = brute_steps(copy)
        expected[str(rank)] = sum(steps) / len(steps) * 1e-6
    (folder / "notes.txt").write_text("not a trace")
    res = _run_analyze("--json", str(folder))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert len(out["traces"]) == 4 and {t["rank"] for t in out["traces"]} == set(expected)
    summary = out["summary"]
    assert {k: v["step_seconds"] for k, v in summary["ranks"].items()} == pytest.approx(expected)
    # no collective in these traces: step time alone names no straggler (every rank of a
    # synchronous job shares it); the spread is said
    assert summary["straggler_rank"] is None and "no collective" in summary["straggler_why"]
    assert summary["spread"] == pytest.approx(max(expected.values()) / min(expected.values()) - 1)
    # the text output: one row per trace (4 > 3) and the summary, not four full reports
    text = _run_analyze(str(folder))
    assert text.returncode == 0, text.stderr
    assert "cross-rank summary" in text.stdout and "no collective in the traces" in text.stdout
    assert "step time breakdown" not in text.stdout and len(text.stdout.splitlines()) < 30
    empty = tmp_path / "empty"
    empty.mkdir()
    res = _run_analyze(str(empty))
    assert res.returncode == 2 and "no trace" in res.stderr and "Traceback" not in res.stderr


def test_a_window_of_n_iterations_holds_n_steps(tmp_path: Path) -> None:
    """libkineto starts an ACTIVITIES_ITERATIONS=N window at an iteration boundary and
    stops it at the N-th step() after: N optimizer steps, N whole iterations (as a real
    `profagent trace --iterations 5` of examples/train.py gave: 5 Optimizer.step ranges,
    the first 28.7 ms after the window's start). A duration window keeps N-1."""
    def x(name: str, cat: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}

    events = [x("aten::mm", "cpu_op", 1000.0, 5.0)]
    for k, ts in enumerate((1030.0, 1065.0, 1100.0)):
        events += [x("aten::mm", "cpu_op", ts - 20, 10.0), x("Optimizer.step#SGD.step", "user_annotation", ts, 2.0)]
        events.append(x("aten::add_", "cpu_op", ts + 0.5, 1.0 + k))
    path = _write(tmp_path, {"traceEvents": events})
    by_duration = analyze(read_trace(path))
    by_iterations = analyze(read_trace(path), iteration_window=True)
    assert [s.seconds * 1e6 for s in by_duration.steps] == pytest.approx([35.0, 35.0])
    assert [s.seconds * 1e6 for s in by_iterations.steps] == pytest.approx([30.0, 35.0, 35.0])
    assert by_iterations.step_source == "optimizer"


def test_an_iteration_window_ends_at_its_record_window_end(tmp_path: Path) -> None:
    """libkineto ends an N-iteration window at the N-th step(), inside that optimizer step's
    range, and writes "Record Window End" there; torch's recording is stopped later, on
    another thread, while the job goes on (a real `--iterations 2` on a loaded node held 7
    Optimizer.step ranges, the third starting 26.8 ms after the window's end). The steps are
    the window's; a duration window is left as it was."""
    def x(name: str, cat: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}

    events = [x("aten::mm", "cpu_op", 1000.0, 5.0)]
    for ts in (1030.0, 1065.0, 1100.0, 1135.0):
        events += [x("aten::mm", "cpu_op", ts - 20, 10.0), x("Optimizer.step#SGD.step", "user_annotation", ts, 2.0)]
    end = 1066.0  # inside the second optimizer step
    events.append({"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": end})
    events.append({"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": 1.0})  # not believed
    path = _write(tmp_path, {"traceEvents": events})
    trace = read_trace(path)
    assert trace.window_end == end
    # brute force: the window's iterations run from its start to each optimizer step that began before its end
    marks = [e["ts"] for e in events if e["name"].startswith("Optimizer.step#") and e["ts"] < end]
    bounds = [min(e["ts"] for e in events if e["ph"] == "X")] + marks
    expected = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert expected == [30.0, 35.0]
    by_iterations = analyze(trace, iteration_window=True)
    assert [s.seconds * 1e6 for s in by_iterations.steps] == pytest.approx(expected)
    by_duration = analyze(read_trace(path))
    assert [s.seconds * 1e6 for s in by_duration.steps] == pytest.approx([35.0, 35.0, 35.0])

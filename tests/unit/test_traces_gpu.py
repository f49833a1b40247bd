"""GPU figures of every shared real trace, checked against an independent brute force.

The reference reads the raw JSON with the standard library and computes coverage on the
grid of every event boundary with a numpy difference array (no interval merging, no
shared code with profagent). Each elementary segment is then labelled directly.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from helpers.paths import shared_traces
from profagent.analysis.trace.report import analyze
from profagent.sources.traces.reader import read_trace

TRACES = sorted(shared_traces().glob("*.pt.trace.json.gz"))
PRIORITY = ("kernel", "memcpy", "memset", "communication", "runtime", "dataloader", "cpu_exec")


def _raw(path: Path) -> dict:
    with gzip.open(path, "rt") as fh:
        return json.load(fh)


class Reference:
    """Brute-force figures of one trace."""

    def __init__(self, path: Path) -> None:
        events = [e for e in _raw(path)["traceEvents"] if e.get("ph") == "X"]
        gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        device_pids = {e["pid"] for e in gpu}
        # cuda_sync on a GPU stream row is a wait on the device, not a CPU runtime call
        runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                   or (e.get("cat") == "cuda_sync" and e["pid"] not in device_pids)]
        step_events = sorted((e for e in events if e.get("cat") in ("user_annotation", "cpu_op")
                              and str(e.get("name", "")).startswith("ProfilerStep#")),
                             key=lambda e: (e["ts"], -e["dur"]))
        steps: list[tuple[float, float]] = []
        for e in step_events:  # CPU ranges; one inside a kept one is a duplicate or nested
            s, end = e["ts"], e["ts"] + e["dur"]
            if end <= s or (steps and end <= steps[-1][1]):
                continue
            steps.append((max(s, steps[-1][1]) if steps else s, end))
        self.incomplete = []
        if len(steps) >= 2:  # the last step is a stub: see brute_steps in test_traces_steps.py
            marks = [e["ts"] for e in events if e.get("cat") in ("user_annotation", "cpu_op")
                     and e.get("name", "").startswith("Optimizer.step#")]
            has = [any(s <= m < e for m in marks) for s, e in steps]
            durations = [e - s for s, e in steps]
            stub = (not has[-1]) if all(has[:-1]) else durations[-1] < min(durations[:-1]) / 2
            if stub:
                self.incomplete.append(steps.pop())
        self.inferred = not steps
        if steps:
            self.steps = steps
        else:
            kept = [e for e in events if e.get("cat") in
                    ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "cuda_sync",
                     "cpu_op", "user_annotation")]
            self.steps = [(min(e["ts"] for e in kept), max(e["ts"] + e["dur"] for e in kept))]

        def comm(e: dict) -> bool:
            return e["cat"] == "kernel" and ("nccl" in e["name"].lower() or "rccl" in e["name"].lower())

        self.sets = {
            "kernel": [e for e in gpu if e["cat"] == "kernel" and not comm(e)],
            "allkernel": [e for e in gpu if e["cat"] == "kernel"],
            "memcpy": [e for e in gpu if e["cat"] == "gpu_memcpy"],
            "memset": [e for e in gpu if e["cat"] == "gpu_memset"],
            "comm_kernel": [e for e in gpu if comm(e)],
            "gpu": gpu,
            "runtime": runtime,
        }
        cpu_ops = [e for e in events if e.get("cat") == "cpu_op" and not e["name"].startswith("ProfilerStep#")]
        ann = [e for e in events if e.get("cat") == "user_annotation"]
        comm_prefix = ("nccl:", "gloo:", "c10d::", "record_param_comms", "mpi:")
        self.sets["dataloader"] = [e for e in cpu_ops + ann if e["name"].startswith("enumerate(DataLoader)")]
        self.sets["communication"] = self.sets["comm_kernel"] + [
            e for e in cpu_ops + ann if e["name"].startswith(comm_prefix)
            and not e["name"].startswith("enumerate(DataLoader)")]
        self.sets["cpu_exec"] = [e for e in cpu_ops if not e["name"].startswith(("enumerate(DataLoader)", *comm_prefix))]

        points = {p for s in self.steps for p in s}
        for group in self.sets.values():
            for e in group:
                points.add(e["ts"])
                points.add(e["ts"] + e["dur"])
        self.points = np.array(sorted(points))
        self.seg = np.diff(self.points)
        self.window = self._cover([{"ts": s, "dur": e - s} for s, e in self.steps])

    def _cover(self, spans: list[dict]) -> np.ndarray:
        diff = np.zeros(len(self.points) + 1)
        if spans:
            starts = np.searchsorted(self.points, [e["ts"] for e in spans])
            ends = np.searchsorted(self.points, [e["ts"] + e["dur"] for e in spans])
            np.add.at(diff, starts, 1)
            np.add.at(diff, ends, -1)
        return (np.cumsum(diff)[: len(self.seg)] > 0)

    def time(self, mask: np.ndarray) -> float:
        return float(self.seg[mask & self.window].sum())

    def cover(self, name: str) -> np.ndarray:
        return self._cover(self.sets[name])


@pytest.fixture(scope="module", params=TRACES, ids=[p.name.split(".")[0] for p in TRACES])
def pair(request: pytest.FixtureRequest) -> tuple[Reference, object]:
    return Reference(request.param), analyze(read_trace(request.param))


def test_all_shared_traces_present() -> None:
    assert len(TRACES) == 7, TRACES


def test_steps_match(pair) -> None:
    ref, report = pair
    assert report.steps_inferred == ref.inferred
    assert len(report.steps) == len(ref.steps)
    for step, (s, e) in zip(report.steps, ref.steps, strict=True):
        assert step.seconds == pytest.approx((e - s) * 1e-6, rel=1e-9, abs=1e-12)


def test_gpu_unions_match(pair) -> None:
    ref, report = pair
    window = ref.time(np.ones_like(ref.window))
    busy = ref.cover("gpu")
    if ref.time(busy) == 0:
        assert report.gpu is None
        return
    g = report.gpu
    assert g is not None and g.devices == 1  # every shared trace has one device per rank
    compute = ref.cover("kernel")
    comm = ref.cover("comm_kernel")
    assert g.idle_ratio == pytest.approx(1 - ref.time(busy) / window, abs=1e-9)
    assert g.utilization == pytest.approx(ref.time(ref.cover("allkernel")) / window, abs=1e-9)
    assert g.compute_ratio == pytest.approx(ref.time(compute) / window, abs=1e-9)
    assert g.non_compute_ratio == pytest.approx(ref.time(busy & ~compute) / window, abs=1e-9)
    assert g.memcpy_share == pytest.approx(ref.time(ref.cover("memcpy")) / ref.time(busy), abs=1e-9)
    if ref.time(comm) > 0:
        assert g.overlap_ratio == pytest.approx(ref.time(comm & compute) / ref.time(comm), abs=1e-9)
    else:
        assert g.overlap_ratio is None
    parts = g.host_wait_ratio + g.kernel_wait_ratio + g.idle_other_ratio
    assert parts == pytest.approx(g.idle_ratio, abs=1e-9)
    assert min(g.host_wait_ratio, g.kernel_wait_ratio, g.idle_other_ratio) >= 0


def test_breakdown_by_priority_matches(pair) -> None:
    ref, report = pair
    window = ref.time(np.ones_like(ref.window))
    left = np.ones_like(ref.window)
    for name in PRIORITY:
        mask = ref.cover(name) & left
        assert report.breakdown[name] == pytest.approx(ref.time(mask) / window, abs=1e-9), name
        left &= ~mask
    assert report.breakdown["other"] == pytest.approx(ref.time(left) / window, abs=1e-9)
    assert sum(report.breakdown.values()) == pytest.approx(1.0)


def test_launch_delay_median_matches(pair) -> None:
    ref, report = pair
    launch = {e["args"]["correlation"]: e["ts"] for e in ref.sets["runtime"] if "correlation" in e.get("args", {})}
    delays = sorted(max(0.0, k["ts"] - launch[k["args"]["correlation"]])
                    for k in ref.sets["allkernel"] if k.get("args", {}).get("correlation") in launch)
    if not delays:
        assert report.launch_delay is None
        return
    assert report.launch_delay["p50"] == pytest.approx(delays[(len(delays) - 1) // 2] * 1e-6)
    assert report.launch_delay["max"] == pytest.approx(delays[-1] * 1e-6)


def test_known_facts_of_the_shared_traces() -> None:
    by_name = {p.name.split(".")[0]: analyze(read_trace(p)) for p in TRACES}
    assert by_name["a100-2gpu-nccl"].rank == "0" and len(by_name["a100-2gpu-nccl"].steps) == 3
    assert len(by_name["a100-80gb-rank0"].steps) == 5
    assert len(by_name["v100-rank0"].steps) == 5
    assert by_name["a100-alexnet-cudasync"].steps_inferred
    assert by_name["cpu-only-rank34"].rank == "34" and by_name["cpu-only-rank34"].gpu is None
    assert by_name["mi250-rocm"].rank is None and by_name["mi250-rocm"].gpu is not None  # ROCm kernels
    assert by_name["small-gpu-rank0"].gpu.overlap_ratio is not None  # NCCL kernels present
    # the V100 trace is GPU bound: kernels run ~97% of the step time
    assert by_name["v100-rank0"].gpu.utilization > 0.9


@pytest.mark.parametrize("name", ["mi250-rocm", "a100-alexnet-cudasync", "cpu-only-rank34"])
def test_top_ops_self_time_brute_force(name: str) -> None:
    path = shared_traces() / f"{name}.pt.trace.json.gz"
    ops = [e for e in _raw(path)["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"
           and not e["name"].startswith("ProfilerStep#")]
    spans = [(e["pid"], e["tid"], e["ts"], e["ts"] + e["dur"]) for e in ops]
    own = {i: e - s for i, (_, _, s, e) in enumerate(spans)}
    for j, (p, t, s, e) in enumerate(spans):
        # containers; of identical ranges, the one written first is the parent
        parents = [i for i, (p2, t2, s2, e2) in enumerate(spans)
                   if (p2, t2) == (p, t) and s2 <= s and e <= e2 and ((s2, e2) != (s, e) or i < j)]
        if parents:
            parent = min(parents, key=lambda i: (spans[i][3] - spans[i][2], -i))
            own[parent] -= e - s
    expected: dict[str, float] = {}
    for i, e in enumerate(ops):
        expected[e["name"]] = expected.get(e["name"], 0.0) + max(own[i], 0.0)
    report = analyze(read_trace(path), top_k=1000)
    got = {n: s for n, s, _ in report.top_ops}
    assert set(got) == set(expected)
    for n, seconds in expected.items():
        assert got[n] == pytest.approx(seconds * 1e-6, abs=1e-9), n


def test_idle_split_brute_force(pair) -> None:
    ref, report = pair
    busy = ref.cover("gpu")
    if ref.time(busy) == 0:
        return
    gap = ref.window & ~busy
    # maximal runs of idle segments
    edges = np.diff(np.concatenate([[0], gap.astype(int), [0]]))
    starts, ends = ref.points[np.flatnonzero(edges == 1)], ref.points[np.flatnonzero(edges == -1)]
    launch = {e["args"]["correlation"]: e["ts"] for e in ref.sets["runtime"] if "correlation" in e.get("args", {})}
    first_at: dict[float, dict] = {}
    for e in sorted(ref.sets["gpu"], key=lambda e: e["ts"]):
        first_at.setdefault(e["ts"], e)
    host = queued = other = 0.0
    for gs, ge in zip(starts.tolist(), ends.tolist(), strict=True):
        op = first_at.get(ge)
        t = launch.get(op.get("args", {}).get("correlation")) if op else None
        if t is None:
            other += ge - gs
        else:
            cut = min(max(t, gs), ge)
            host += cut - gs
            queued += ge - cut
    window = ref.time(np.ones_like(ref.window))
    g = report.gpu
    assert g.host_wait_ratio == pytest.approx(host / window, abs=1e-9)
    assert g.kernel_wait_ratio == pytest.approx(queued / window, abs=1e-9)
    assert g.idle_other_ratio == pytest.approx(other / window, abs=1e-9)

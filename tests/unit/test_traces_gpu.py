"""GPU figures of every shared real trace, checked against an independent brute force
(helpers/traces.Reference: no shared code with profagent)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers.paths import shared_traces
from helpers.traces import PRIORITY, Reference, raw_trace
from profagent.analysis.trace.report import analyze
from profagent.sources.traces.reader import read_trace

SHARED = sorted(shared_traces().glob("*.pt.trace.json.gz"))
# Ours, from an H100 (tests/unit/fixtures/h100/README.md): an in-process and an on-demand trace
H100 = sorted((Path(__file__).parent / "fixtures" / "h100").glob("*.pt.trace.json.gz"))
TRACES = SHARED + H100


@pytest.fixture(scope="module", params=TRACES, ids=[p.name.split(".")[0] for p in TRACES])
def pair(request: pytest.FixtureRequest) -> tuple[Reference, object]:
    return Reference(request.param), analyze(read_trace(request.param))


def test_all_shared_traces_present() -> None:
    assert len(SHARED) == 7 and len(H100) == 2, TRACES


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
    expected = ref.breakdown()
    assert set(expected) == {*PRIORITY, "other"} == set(report.breakdown)
    for name, share in expected.items():
        assert report.breakdown[name] == pytest.approx(share, abs=1e-9), name
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
    ops = [e for e in raw_trace(path)["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"
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


def test_h100_steps_match_the_workloads_own_timing() -> None:
    """The H100 job timed each step itself, CUDA-synchronised (fixtures/h100). The last
    traced step is left out: the job's clock also counts prof.step() stopping the profiler
    and writing the trace, which the traced step does not hold."""
    folder = Path(__file__).parent / "fixtures" / "h100"
    truth = {e["step"]: e["seconds"] for e in map(json.loads, (folder / "ground-truth-rank0.jsonl").read_text().splitlines())
             if e["event"] == "step"}
    report = analyze(read_trace(folder / "ddp-gloo-rank0.pt.trace.json.gz"))
    steps = [(int(s.name.split("#")[1]), s.seconds) for s in report.steps]
    assert [k for k, _ in steps] == [7, 8, 9] and report.accelerator == "cuda"
    for k, seconds in steps[:-1]:
        assert seconds == pytest.approx(truth[k], abs=2e-3), k

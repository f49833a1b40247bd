"""Right on every accelerator: MTIA DMA is memory transfer, the idle finding names its
largest cause, and per-kernel statistics, launching ops and annotation GPU time match a
brute force over the raw JSON (plain Python, no profagent code). Tolerances are relative
1e-5: profagent measures end - ts in float64, the brute force reads dur (timestamps near
4e12 µs keep about a nanosecond)."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from helpers.paths import shared_traces
from profagent.analysis.trace.report import analyze, readings
from profagent.sources.traces.reader import read_trace

SHARED = ["small-gpu-rank0", "a100-2gpu-nccl", "mi250-rocm"]


def _raw(name: str) -> list[dict]:
    with gzip.open(shared_traces() / f"{name}.pt.trace.json.gz", "rt") as fh:
        return [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]


def _mtia_trace(path: Path) -> Path:
    """One 1000 µs step: a kernel launched at 50 (runs 100-400), two DMA transfers with no
    correlation id (500-600 host to device, 700-750 device to host)."""
    cpu, dev = {"pid": 10, "tid": 10}, {"pid": 0, "tid": 1}
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 1000, **cpu},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 40, "dur": 30, **cpu},
        {"ph": "X", "cat": "mtia_runtime", "name": "launchKernel", "ts": 50, "dur": 10, **cpu,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "mtia_ccp_events", "name": "fwd_kernel", "ts": 100, "dur": 300, **dev,
         "args": {"correlation": 1, "device": 0}},
        {"ph": "X", "cat": "mtia_ccp_events", "name": "dma_request", "ts": 500, "dur": 100, **dev,
         "args": {"direction": "HOST_TO_DEVICE", "device": 0}},
        {"ph": "X", "cat": "mtia_ccp_events", "name": "dma_request", "ts": 700, "dur": 50, **dev,
         "args": {"direction": "DEVICE_TO_HOST", "device": 0}},
    ]
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_mtia_dma_is_memory_transfer(tmp_path: Path) -> None:
    r = analyze(read_trace(_mtia_trace(tmp_path / "mtia.json")))
    assert r.accelerator == "mtia"
    g = r.gpu
    assert g.compute_ratio == pytest.approx(300 / 1000)
    assert g.non_compute_ratio == pytest.approx(150 / 1000)  # the two DMA transfers
    assert g.memcpy_share == pytest.approx(150 / 450)
    assert g.utilization == pytest.approx(300 / 1000)
    assert [name for name, _, _ in r.top_kernels] == ["fwd_kernel"]  # dma_request is no kernel
    assert r.breakdown["memcpy"] == pytest.approx(150 / 1000)
    # gaps: [0,100) ended by the kernel launched at 50: host 50 + queued 50; the gaps
    # ended by the DMA (no correlation) and the step's tail are "other": 100 + 100 + 250
    assert g.host_wait_ratio == pytest.approx(50 / 1000)
    assert g.kernel_wait_ratio == pytest.approx(50 / 1000)
    assert g.idle_other_ratio == pytest.approx(450 / 1000)


def test_idle_finding_names_the_largest_cause_other_included(tmp_path: Path) -> None:
    r = analyze(read_trace(_mtia_trace(tmp_path / "mtia.json")))
    idle = [f for f in readings(r) if f.startswith("the GPU is idle")]
    assert len(idle) == 1
    assert "mostly because of gaps no launched work explains (other" in idle[0]
    assert "45.0% of step time" in idle[0]


@pytest.mark.parametrize("name", SHARED)
def test_kernel_stats_and_launching_op_brute_force(name: str) -> None:
    events = _raw(name)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops: dict[tuple, list[dict]] = {}  # by thread: a call is launched from its own thread's ops
    for e in events:
        if e.get("cat") == "cpu_op" and not e["name"].startswith("ProfilerStep#"):
            ops.setdefault((e["pid"], e["tid"]), []).append(e)

    def innermost(call: dict) -> str | None:
        around = [o for o in ops.get((call["pid"], call["tid"]), ()) if o["ts"] <= call["ts"] < o["ts"] + o["dur"]]
        # the innermost: latest start; of equal starts, the shortest
        return max(around, key=lambda o: (o["ts"], -o["dur"]))["name"] if around else None

    r = analyze(read_trace(shared_traces() / f"{name}.pt.trace.json.gz"), top_k=5)
    assert r.kernel_stats
    for stats in r.kernel_stats:
        mine = [k for k in kernels if k["name"] == stats["name"]]
        durs = [k["dur"] * 1e-6 for k in mine]
        assert stats["count"] == len(mine)
        assert stats["total"] == pytest.approx(sum(durs), rel=1e-5, abs=1e-9)
        assert stats["mean"] == pytest.approx(sum(durs) / len(durs), rel=1e-5, abs=1e-9)
        assert stats["min"] == pytest.approx(min(durs), rel=1e-5, abs=1e-9)
        assert stats["max"] == pytest.approx(max(durs), rel=1e-5, abs=1e-9)
        launchers = Counter(innermost(runtime[k["args"]["correlation"]]) for k in mine
                            if k.get("args", {}).get("correlation") in runtime)
        launchers.pop(None, None)
        if not launchers:
            assert stats["launched_by"] is None
        else:
            best = max(launchers.values())
            assert stats["launched_by"] in {n for n, c in launchers.items() if c == best}


@pytest.mark.parametrize("name", SHARED)
def test_annotation_gpu_time_brute_force(name: str) -> None:
    events = _raw(name)
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
           and e.get("args", {}).get("correlation") in runtime]
    expected: dict[str, float] = {}
    for a in events:
        if a.get("cat") != "user_annotation" or a["name"].startswith("ProfilerStep#"):
            continue
        inside = sum(g["dur"] for g in gpu if (runtime[g["args"]["correlation"]]["pid"],
                                                 runtime[g["args"]["correlation"]]["tid"]) == (a["pid"], a["tid"])
                     and a["ts"] <= runtime[g["args"]["correlation"]]["ts"] < a["ts"] + a["dur"])
        if inside > 0:
            expected[a["name"]] = expected.get(a["name"], 0.0) + inside
    r = analyze(read_trace(shared_traces() / f"{name}.pt.trace.json.gz"), top_k=1000)
    assert set(r.annotation_gpu) == set(expected)
    for n, us in expected.items():
        assert r.annotation_gpu[n] == pytest.approx(us * 1e-6, rel=1e-5, abs=1e-9), n

"""GET /api/ranks's document, built from real snapshots with an injected clock."""

from __future__ import annotations

from types import MappingProxyType

import orjson

from profagent.contracts import (
    Finding,
    GpuDevice,
    GpuSnapshot,
    GroupUsage,
    HostSnapshot,
    NodeUsage,
    ProcessGpuUsage,
    ProcessInfo,
    ProcessTree,
    RankStall,
    StackGroup,
    StacksSnapshot,
    Usage,
)
from profagent.exporters.api.ranks import CounterHistory, Counters, RanksApi, ranks_payload
from profagent.exporters.api.ranks_doc import as_json, read_ranks
from profagent.state import State

JOB = "job-7"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tree() -> ProcessTree:
    procs = [ProcessInfo(10, 1, 0.0, "launcher", "", "", "", "torchrun", JOB)]
    for rank in ("0", "1"):
        procs.append(ProcessInfo(100 + int(rank), 10, 0.0, "main", rank, rank, "2", "train.py", JOB))
    procs.append(ProcessInfo(200, 100, 0.0, "dataloader", "0", "0", "2", "train.py", JOB))
    return ProcessTree(JOB, 10, tuple(procs), True)


def host(cpu0: float, cpu1: float) -> HostSnapshot:
    groups = (
        GroupUsage(JOB, "0", "main", 1, Usage(cpu_user=cpu0, cpu_system=0.0, rss=300 << 20, threads=7)),
        GroupUsage(JOB, "0", "dataloader", 1, Usage(cpu_user=1.0, rss=100 << 20)),
        GroupUsage(JOB, "1", "main", 1, Usage(cpu_user=cpu1, rss=200 << 20, threads=5)),
    )
    return HostSnapshot(groups, NodeUsage(0.5, 64 << 30, 32 << 30, 8))


def stacks(forward: int, collective: int, stalled: bool) -> StacksSnapshot:
    groups = (
        StackGroup("0", "main", (("forward", forward), ("dataloader", forward // 2)), (("step", forward), ("other", 3)), (), JOB),
        StackGroup("1", "main", (("forward", 10), ("collective", collective)), (("all_reduce", collective), ("step", 10)), (), JOB),
    )
    return StacksSnapshot(JOB, groups, (RankStall("0", False, 0.5, JOB), RankStall("1", stalled, 42.0, JOB)), ())


def gpu() -> GpuSnapshot:
    devices = tuple(GpuDevice(i, f"GPU-{i}", "NVIDIA H100", f"0:{i}", "", True,
                              MappingProxyType({"utilization_ratio": 0.9 - i * 0.9, "memory_used_bytes": 10 << 30,
                                                "memory_total_bytes": 80 << 30})) for i in (0, 1))
    processes = (ProcessGpuUsage(JOB, "0", "main", 0, "GPU-0", "", 1, 9 << 30, 0.8, 0.4),
                 ProcessGpuUsage(JOB, "1", "main", 1, "GPU-1", "", 1, 8 << 30, None, None))
    return GpuSnapshot(JOB, True, "550", "12", "12.4", devices, processes)


def test_rates_and_shares_describe_the_change_since_the_baseline() -> None:
    clock = Clock()
    state = State(clock=clock)
    state.set_tree(tree())
    state.publish("host", host(10.0, 20.0), 0.01)
    state.publish("stacks", stacks(100, 0, False), 0.01)
    state.publish("gpu", gpu(), 0.01)
    api = RanksApi(lambda: [state.view()], "node-a", wall=clock)
    first = as_json(api.document())
    assert [r["cpu_percent"] for r in first["jobs"][0]["ranks"]] == [None, None]  # no baseline yet

    clock.now += 4.0
    state.publish("host", host(13.0, 20.2), 0.01)  # rank 0: +3 s CPU in 4 s, rank 1: +0.2 s
    state.publish("stacks", stacks(160, 90, True), 0.01)
    doc = orjson.loads(api.route({})[2])  # what the HTTP route serves
    assert doc["node"] == "node-a" and doc["time"] == clock.now
    job = doc["jobs"][0]
    assert (job["job_id"], job["world_size"], job["alive"], job["root_pid"]) == (JOB, 2, True, 10)
    r0, r1 = job["ranks"]
    assert (r0["rank"], r1["rank"]) == ("0", "1")
    assert r0["cpu_percent"] == 100 * 3.0 / 4.0
    assert abs(r1["cpu_percent"] - 100 * 0.2 / 4.0) < 1e-9
    # shares of the recent samples only: rank 0 +60 forward, +30 dataloader
    assert r0["categories"] == {"forward": 60 / 90, "dataloader": 30 / 90} and r0["categories_recent"]
    assert r1["categories"] == {"collective": 1.0}
    assert r1["top_function"] == "all_reduce" and r1["top_function_share"] == 1.0
    assert r0["top_function"] == "step"  # "other" is never the top function
    assert (r0["state"], r0["stalled_seconds"]) == ("running", None)
    assert (r1["state"], r1["stalled_seconds"]) == ("stalled", 42.0)
    assert (r0["rss_bytes"], r0["threads"], r0["workers"], r0["workers_rss_bytes"]) == (300 << 20, 7, 1, 100 << 20)
    assert r0["uss_bytes"] is None  # the host source has no USS here: absent, not 0
    assert r0["gpu"] == {"gpus": [0], "utilization_ratio": 0.8, "memory_bytes": 9 << 30}
    assert r1["gpu"] == {"gpus": [1], "utilization_ratio": 0.0, "memory_bytes": 8 << 30}  # the device's
    assert job["gpu"]["count"] == 2 and job["gpu"]["simulated"] is True
    assert job["gpu"]["memory_total_bytes"] == 160 << 30
    assert job["findings"] == []  # no findings engine: no findings, no error
    assert r0["step"] is None
    # What the client reads back is the document the route built: one shape at both ends.
    read = read_ranks(doc)
    assert as_json(read) == doc
    row = read.jobs[0].ranks[1]
    assert (row.state, row.stalled_seconds, row.gpu.gpus, row.step_seconds) == ("stalled", 42.0, (1,), None)


def test_findings_snapshot_shows_in_its_job() -> None:
    class FindingsSnapshot:
        findings = (Finding("hang", JOB, "1", "critical", "rank 1 stuck in all_reduce for 42 s", since=5.0),
                    Finding("gpu_idle", "other-job", None, "warning", "elsewhere"))

    state = State()
    state.set_tree(tree())
    state.publish("findings", FindingsSnapshot(), 0.0)
    job = as_json(ranks_payload([state.view()], {}, "n", 0.0))["jobs"][0]
    assert [f["finding"] for f in job["findings"]] == ["hang"]
    assert job["findings"][0]["rank"] == "1" and job["findings"][0]["severity"] == "critical"


def test_history_keeps_a_baseline_within_the_horizon() -> None:
    history = CounterHistory(horizon=10.0)
    key = (JOB, "0")
    assert history.baseline(key, Counters(0.0, 1.0)) is None
    assert history.baseline(key, Counters(0.0, 1.0)).time == 0.0  # same reading again: baseline kept
    for t in (5.0, 10.0, 15.0):
        base = history.baseline(key, Counters(t, t))
    assert base.time == 5.0  # the oldest reading not older than the horizon
    history.forget_except(set())
    assert history.baseline(key, Counters(20.0, 1.0)) is None


def test_a_hostile_document_reads_as_defaults_field_by_field() -> None:
    """The client reads /api/ranks from the network: a value of the wrong type reads as its
    field's default, a finding without its kind or of an unknown kind is left out."""
    doc = read_ranks({"node": 7, "time": float("nan"), "jobs": [
        "not a job",
        {"job_id": "j", "alive": "yes", "world_size": True, "gpu": {"count": "8", "names": ["a", 3]},
         "sources": {"host": True, "gpu": "up"},
         "findings": [{"finding": "hang", "job_id": "j", "rank": "1", "severity": "critical", "summary": "s"},
                      {"finding": "no_such_kind", "job_id": "j", "rank": None, "severity": "info", "summary": "s"},
                      {"job_id": "j"}],
         "ranks": [{"rank": "0", "pid": "100", "state": "gone", "cpu_percent": 1e400, "threads": 1.5,
                    "functions": [{"function": "f", "share": 0.5}, {"function": 1, "share": 0.5}],
                    "timeline": {"p50_seconds": 0.25, "lost_events": "many"}, "step": {"mean_seconds": 0.5}}]},
    ]})
    assert (doc.node, doc.time) == ("?", 0.0)
    [job] = doc.jobs
    assert (job.alive, job.world_size, job.gpu.count, job.gpu.names, dict(job.sources)) == (True, None, 0, ("a",),
                                                                                             {"host": True})
    assert [f.finding for f in job.findings] == ["hang"]
    [row] = job.ranks
    assert (row.pid, row.state, row.cpu_percent, row.threads) == (None, "running", None, None)
    assert [f.function for f in row.functions] == ["f"]
    assert (row.step_seconds, row.lost_events) == (0.25, 0)  # the probes' p50 before the trace's mean
    assert read_ranks([1, 2]) == read_ranks({})

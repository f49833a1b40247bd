"""The /metrics body for a fixed state is byte-identical to the one before the layout change.

The state is hand-built from the real snapshot types of every source (host, gpu, stacks,
traces, ondemand) plus collector health, like bench/synthetic.py, with a fixed clock.
Only ``profagent_*`` lines are compared: the agent's own ``process_*``/``python_*``
families describe the test process.

How the golden files were produced (once, from the commit before the layout change,
2202f00, whose modules lived under ``profagent.agent``; ``_module`` falls back to those
names)::

    git worktree add /tmp/old 2202f00
    PYTHONPATH=/tmp/old/src python tests/unit/test_exposition_golden.py --write

Regenerate them only when a family legitimately changes, and say so in the commit
(``PYTHONPATH=src python tests/unit/test_exposition_golden.py --write``). Since the layout
change they were regenerated once, on purpose, for: the pod/Slurm/user labels of
``profagent_target_info`` (#18), the trace accelerator and incomplete-step families and no
step time for a trace without steps (#14), worker USS and collectors not applicable (#15),
every GPU value family, findings and incidents, so that the golden exposition names every
family the README documents (#23, ``tests/unit/test_docs.py`` holds the two together), the
per-rank collective-wait share (#24), CPU per collector (#26), the step timeline from kernel probes (#38),
each hung rank's part in the hang (``profagent_hang_rank_info``, #39), steps whose start is
not an Optimizer.step call (the step families' help, #50).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path
from types import MappingProxyType, ModuleType

import pytest

from profagent.system.cputime import CpuAccount

GOLDEN = Path(__file__).parent / "golden"
FORMATS = {
    "text": ("text/plain", "exposition.txt"),
    "openmetrics": ("application/openmetrics-text; version=1.0.0", "exposition.openmetrics.txt"),
}
JOB = "golden-job"
NOW = 1_700_000_000.0

# Module now -> module at 2202f00 (only used when generating the golden files there).
_OLD = {
    "profagent.state": "profagent.agent.state",
    "profagent.target": "profagent.agent.target",
    "profagent.sources.host": "profagent.agent.sources.host",
    "profagent.sources.gpu.source": "profagent.agent.sources.gpu",
    "profagent.sources.gpu.device": "profagent.agent.nvml.device",
    "profagent.sources.stacks.source": "profagent.agent.sources.stacks",
    "profagent.sources.traces.source": "profagent.agent.sources.traces",
    "profagent.analysis.trace.report": "profagent.agent.analysis.report",
    "profagent.sources.ondemand.source": "profagent.agent.sources.ondemand",
    "profagent.exporters.exposition": "profagent.exporters.prometheus",
}


def _module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return importlib.import_module(_OLD[name])


def _timeline_snapshot():  # -> TimelineSnapshot (absent before #38)
    timeline = importlib.import_module("profagent.contracts")
    stages = {"data_wait": 1.5, "backward": 4.0, "optimizer": 1.0, "other": 3.5}
    buckets = tuple(10 if i == 6 else 0 for i in range(15))
    lags = tuple(18 if i == 3 else 2 if i == 8 else 0 for i in range(15))
    ranks = tuple(
        timeline.RankSteps(JOB, rank, pid, 11, 10, 1.0, buckets, stages, 40, 120, 10, 0.1, 0.11, 0.12, 9.5, 4.0,
                           {k: v / 10 for k, v in stages.items()}, "backward", 0.01, 0.05, lags, 0.125, 20)
        for rank, pid in (("0", 100), ("1", 200)))
    library = timeline.ProbedLibrary("/venv/lib/libtorch_cpu.so", "b7066ed94f422786", ("rf_enter", "bwd"), ())
    return timeline.TimelineSnapshot(ranks, (), (library,), 1000, 0, 12, 60.0)


def golden_state():  # -> profagent.state.State
    target = _module("profagent.target")
    host = _module("profagent.sources.host")
    gpu = _module("profagent.sources.gpu.source")
    device = _module("profagent.sources.gpu.device")
    stacks = _module("profagent.sources.stacks.source")
    if not hasattr(stacks, "RankStall"):  # the stacks source no longer imports every contract it once did
        stacks = importlib.import_module("profagent.contracts")
    traces = _module("profagent.sources.traces.source")
    report = _module("profagent.analysis.trace.report")
    ondemand = _module("profagent.sources.ondemand.source")
    state = _module("profagent.state").State(clock=lambda: NOW)

    long_cmd = "python train.py " + " ".join(f"--option-{i}=value" for i in range(40))
    procs = (
        target.ProcessInfo(100, 1, 1.0, "main", "0", "0", "2", long_cmd, JOB),
        target.ProcessInfo(101, 100, 1.0, "dataloader", "0", "0", "2", "python train.py", JOB),
        target.ProcessInfo(200, 1, 1.0, "main", "1", "1", "2", "python train.py --rank 1", JOB),
    )
    state.set_tree(target.ProcessTree(JOB, 100, procs, True))
    for name in ("host", "gpu", "stacks", "traces", "ondemand", "timeline"):
        state.register(name)

    usage = host.Usage(
        cpu_user=12.5, cpu_system=1.25, cpu_iowait=0.5, rss=2 << 30, threads=17, fds=42,
        read_bytes=1 << 20, write_bytes=4096, ctx_voluntary=1000, ctx_involuntary=10, run_queue=3.25,
    )
    state.publish("host", host.HostSnapshot(
        (host.GroupUsage(JOB, "0", "main", 1, usage), host.GroupUsage(JOB, "0", "dataloader", 1, _with_uss(usage)),
         host.GroupUsage(JOB, "1", "main", 1, usage)),
        host.NodeUsage(0.25, 1 << 36, 1 << 35, 8),
    ), 0.002)

    values = MappingProxyType({
        "utilization_ratio": 0.75, "memory_utilization_ratio": 0.5, "memory_used_bytes": 1 << 30,
        "memory_free_bytes": 3 << 30, "memory_total_bytes": 4 << 30, "power_usage_watts": 250.0,
        "energy_joules": 123456.0, "temperature_celsius": 61.0, "sm_clock_hertz": 1.41e9,
        **_all_gpu_values(),
    })
    mig = device.MigDevice(1, 0, "MIG-1", "1g.10gb", 10 << 30, 1 << 30, 9 << 30)
    state.publish("gpu", gpu.GpuSnapshot(
        JOB, False, "550.54", "12.550", "12.4",
        (
            gpu.GpuDevice(0, "GPU-0", "NVIDIA H100", "0000:01:00.0", "disabled", True, values,
                          MappingProxyType({"sw_power_cap": True, "hw_slowdown": False}),
                          MappingProxyType({79: 2}), (), 1),
            gpu.GpuDevice(1, "GPU-1", "NVIDIA H100", "0000:02:00.0", "enabled", True,
                          MappingProxyType({"memory_total_bytes": 80 << 30}), mig_devices=(mig,)),
            gpu.GpuDevice(2, "GPU-2", "NVIDIA H100", "0000:03:00.0", "disabled", False,
                          xid_errors=MappingProxyType({48: 1})),
        ),
        (
            gpu.ProcessGpuUsage(JOB, "0", "main", 0, "GPU-0", "", 1, 1 << 29, 0.6, 0.3),
            gpu.ProcessGpuUsage(JOB, "1", "main", 1, "GPU-1", "1", 1, None, None, None),
        ),
    ), 0.003)

    functions = (("x" * 300 + " (long.py)", 500),)
    functions += tuple((f"function_{i} (module_{i % 3}.py)", 100 - i) for i in range(15))
    state.publish("stacks", stacks.StacksSnapshot(
        JOB,
        (
            stacks.StackGroup("0", "main", (("compute", 50), ("idle", 7)), functions,
                              (("active", "held", 3), ("idle", "not_held", 9)), job_id=JOB),
            stacks.StackGroup("1", "main", (("dataloader", 4),), (("step (train.py)", 4),), (), job_id=JOB),
        ),
        (stacks.RankStall("0", False, 1.5, JOB), stacks.RankStall("1", True, 300.0, JOB)),
        ((JOB, "pyspy_failed", 2),),
    ), 0.004)

    def trace_report(rank: str, gpu_summary: object, launch: dict[str, float] | None):
        rows = (("k" * 200, 0.5, 1), ("k" * 200 + "2", 0.25, 1))  # shortened to one name
        rows += tuple((f"aten::op_{i}", 0.01 * (20 - i), i + 1) for i in range(14))
        return report.TraceReport(
            path=f"/traces/rank{rank}.pt.trace.json", rank=rank, bytes=123456,
            steps=(report.StepTime("ProfilerStep#1", 0.5, {"kernel": 0.3}),
                   report.StepTime("ProfilerStep#2", 0.7, {"kernel": 0.4})),
            steps_inferred=rank == "1", step_mean=0.6, step_max=0.7,
            breakdown={"kernel": 0.6, "memcpy": 0.1, "cpu_exec": 0.2, "other": 0.1},
            gpu=gpu_summary, devices=(), launch_delay=launch, cpu_seconds=1.0, gpu_seconds=0.8,
            cpu_gpu_ratio=1.25 if gpu_summary else None, top_ops=rows, top_kernels=rows[:3] if gpu_summary else (),
            annotations=(("forward", 0.3, 2), ("backward", 0.5, 2)),
            memory_peak={"cuda:0": 1 << 30} if gpu_summary else {}, cpu_pids=(100,),
            **({"accelerator": "cuda" if gpu_summary else None, "step_source": "profiler_step",
                "steps_incomplete": (), "steps_dropped": 0, "gpu_lag": None, "warnings": ()}
               if "accelerator" in report.TraceReport.__dataclass_fields__ else {}),
        )

    summary = report.GpuSummary(1, 0.8, 0.2, 0.7, 0.1, 0.05, 0.1, 0.05, 0.4, 0.1)
    state.publish("traces", traces.TracesSnapshot(
        JOB,
        (traces.RankTrace("0", trace_report("0", summary, {"mean": 1e-5, "p50": 8e-6, "p99": 4e-5, "max": 1e-4}),
                          NOW - 30, JOB),
         traces.RankTrace("1", trace_report("1", None, None), NOW - 60, JOB)),
        (("ingested", "", 3), ("invalid", "truncated_json", 1), ("skipped", "too_large", 2)),
        1,
    ), 0.5)

    state.publish("ondemand", ondemand.OndemandSnapshot(
        ((JOB, "0", "main", 1), (JOB, "1", "main", 1)), 1,
        (("poll", 40), ("malformed", 1)), (("requested", 2), ("sent", 2), ("resent", 1), ("expired", 0)),
    ), 0.001)
    _publish_findings_and_incidents(state)
    state.record_error("stacks", "pyspy_failed", 0.01)
    state.record_error("gpu", "nvml_error")
    return state


def golden_cpu() -> CpuAccount:
    """Fixed CPU seconds per collector (the process-wide account holds the test run's own)."""
    cpu = CpuAccount(thread_clock=lambda: 0.0)
    for name, seconds in (("target", 0.25), ("host", 1.5), ("gpu", 0.75), ("traces", 3.0), ("findings", 0.5)):
        cpu.add(name, seconds)
    cpu.add("stacks", 0.5)
    cpu.add_child("stacks", 4.0)
    return cpu


def _with_uss(usage):  # noqa: ANN001, ANN202 (host.Usage, possibly an old one)
    """A DataLoader worker's USS, where the Usage type has it."""
    fields = getattr(usage, "__dataclass_fields__", {})
    return dataclasses.replace(usage, uss=1 << 28) if "uss" in fields else usage


def _all_gpu_values() -> dict[str, float]:
    """Every other GPU value the renderer knows (ECC, fans, PCIe, NVLink...), so that each
    family is in the golden file; absent on older layouts, which had none of them."""
    try:
        names = _module("profagent.exporters.families.gpu").DEVICE_VALUES
    except (ModuleNotFoundError, KeyError, AttributeError):
        return {}
    given = {"utilization_ratio", "memory_utilization_ratio", "memory_used_bytes", "memory_free_bytes",
             "memory_total_bytes", "power_usage_watts", "energy_joules", "temperature_celsius", "sm_clock_hertz"}
    return {name: float(i + 1) for i, name in enumerate(sorted(set(names) - given))}


def _publish_findings_and_incidents(state) -> None:  # noqa: ANN001 (State, possibly an old one)
    try:
        findings = importlib.import_module("profagent.analysis.findings")
        incidents = importlib.import_module("profagent.engine.incidents")
    except ModuleNotFoundError:
        return  # older layouts had neither
    if not hasattr(incidents, "IncidentsSnapshot"):  # engine/incidents became a package; the snapshot is a contract
        incidents = importlib.import_module("profagent.contracts")
    if not hasattr(findings, "Finding"):  # the data contracts moved to profagent.contracts
        findings = importlib.import_module("profagent.contracts")
    state.publish("findings", findings.FindingsSnapshot((
        findings.Finding("straggler", JOB, "1", "warning", "rank 1 is slow", since=NOW - 120),
        findings.Finding("dataloader_bound", JOB, None, "info", "the job waits on data", since=NOW - 60),
        findings.Finding("hang", JOB, "1", "critical", "rank 1 holds the job up", {"diagnosis": "culprit", "roles": {
            "0": {"role": "waiting", "location": "train.py:70"}, "1": {"role": "culprit", "location": "train.py:68"},
        }}, since=NOW - 30),
    ), NOW, ((JOB, "0", 0.61), (JOB, "1", 0.1)), 12), 0.001)
    state.publish("timeline", _timeline_snapshot(), 0.001)
    state.publish("incidents", incidents.IncidentsSnapshot(((JOB, "hang", 1),), ((JOB, "hang", 2),), (("symlink", 1),)), 0.0)
    # An off source with nothing to do here (profagent_collector_not_applicable).
    state.register("nvml_events")
    state.set_down("nvml_events", "no GPU on this node", not_applicable="no_gpu")


def render(content_type: str) -> str:
    module = _module("profagent.exporters.exposition")
    state = golden_state()
    # 2202f00's Exposition took a function returning a list of views (one per job).
    view = (lambda: [state.view()]) if module.__name__.endswith(".prometheus") else state.view
    body, _ = module.Exposition(view, golden_cpu()).render(content_type)
    lines = body.decode().splitlines(keepends=True)
    return "".join(line for line in lines if "profagent_" in line or line == "# EOF\n")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_exposition_matches_the_golden_file_from_before_the_layout_change(fmt: str) -> None:
    content_type, filename = FORMATS[fmt]
    golden = (GOLDEN / filename).read_text()
    assert golden.count("\n") > 200  # the fixed state covers every source
    assert render(content_type) == golden


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    GOLDEN.mkdir(exist_ok=True)
    for content_type, filename in FORMATS.values():
        (GOLDEN / filename).write_text(render(content_type))


def test_control_characters_in_label_values_are_escaped_in_every_format() -> None:
    """Issue 41 item 12: a label value from outside (a trace file's name, a rank, a job id)
    holding ESC, BEL, C1, a tab, a line or bidi separator reaches /metrics as the escape
    labels.printable writes, read back as that text by a Prometheus parser; in both formats."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
    from prometheus_client.parser import text_string_to_metric_families

    from profagent.exporters.exposition import _encode, _Families
    from profagent.exporters.families import Families
    from profagent.labels import printable

    hostile = "0\x1b]2;X\x1b\\\x07\x9b\u202e\u2028\tz\nq\x00é"
    families = Families()
    families.gauge("profagent_x", "doc", ("rank",)).add_metric([hostile], 1)
    for encoder in (generate_latest, generate_openmetrics):
        body = _encode(encoder, _Families(families))
        text = body.decode()
        assert not any(c in text for c in "\x1b\x07\x9b\u202e\u2028\t\x00"), body
        assert "é" in text  # printable text stays as it is
        if encoder is generate_latest:
            [family] = text_string_to_metric_families(text)
            # the parsed value is the printable form of the whole value (its LF as prometheus escapes it)
            assert family.samples[0].labels["rank"] == printable(hostile, keep_newlines=True)

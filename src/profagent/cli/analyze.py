"""The human (rich) and JSON report of analysed traces: ``profagent analyze`` and, later,
``profagent trace`` print it. Works without an agent."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from profagent.analysis.labels import shorten
from profagent.analysis.trace.report import TraceReport, analyze, findings
from profagent.errors import UserError
from profagent.sources.traces.reader import TraceError, read_trace

FIXES = {
    "truncated": "wait until the profiler has finished writing it, or re-export the trace",
    "corrupt": "re-export the trace (prof.export_chrome_trace or tensorboard_trace_handler)",
    "not_a_trace": "pass a torch profiler trace (*.pt.trace.json[.gz])",
    "unreadable": "check the path and its permissions",
}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.1%}"


def render_report(r: TraceReport, console: Console) -> None:
    """Print one trace's report as rich tables plus findings."""
    rank = r.rank if r.rank is not None else "?"
    console.print(f"\n[bold]{r.path}[/bold]  rank {rank}, {r.bytes / 1e6:.1f} MB of JSON", highlight=False)
    if not r.steps:
        console.print("  no events to analyse in this trace (empty traceEvents)")
        return
    steps = Table(title="steps" + (" (no ProfilerStep: whole window)" if r.steps_inferred else ""))
    steps.add_column("step")
    steps.add_column("ms", justify="right")
    for s in r.steps:
        steps.add_row(s.name, _ms(s.seconds))
    if r.steps:
        steps.add_row("[bold]mean[/bold]", _ms(r.step_mean))
        steps.add_row("[bold]max[/bold]", _ms(r.step_max))
    console.print(steps)

    bd = Table(title="step time breakdown")
    bd.add_column("category")
    bd.add_column("share", justify="right")
    for category, ratio in r.breakdown.items():
        bd.add_row(category, _pct(ratio))
    console.print(bd)

    if r.gpu is not None:
        g = r.gpu
        gpu = Table(title=f"GPU ({g.devices} device{'s' if g.devices > 1 else ''}, share of step time)")
        gpu.add_column("figure")
        gpu.add_column("value", justify="right")
        rows = [
            ("utilization (kernels)", _pct(g.utilization)), ("idle", _pct(g.idle_ratio)),
            ("  host wait", _pct(g.host_wait_ratio)), ("  kernel wait", _pct(g.kernel_wait_ratio)),
            ("  other", _pct(g.idle_other_ratio)), ("compute", _pct(g.compute_ratio)),
            ("non-compute", _pct(g.non_compute_ratio)), ("comm overlapped by compute", _pct(g.overlap_ratio)),
            ("memcpy share of GPU time", _pct(g.memcpy_share)),
            ("CPU/GPU time", "-" if r.cpu_gpu_ratio is None else f"{r.cpu_gpu_ratio:.2f}"),
        ]
        if r.launch_delay is not None:
            rows.append(("launch delay p50 / p99 (ms)", f"{_ms(r.launch_delay['p50'])} / {_ms(r.launch_delay['p99'])}"))
        for row in rows:
            gpu.add_row(*row)
        console.print(gpu)

    for title, rows, unit in (("top kernels (GPU time)", r.top_kernels, "launches"),
                              ("top ops (self CPU time)", r.top_ops, "calls"),
                              ("record_function ranges", r.annotations[:10], "count")):
        if not rows:
            continue
        t = Table(title=title)
        t.add_column("name", overflow="fold", max_width=80)
        t.add_column("ms", justify="right")
        t.add_column(unit, justify="right")
        for name, seconds, count in rows:
            t.add_row(shorten(name, 100), _ms(seconds), str(count))
        console.print(t)
    if r.memory_peak:
        console.print("peak allocated: " + ", ".join(f"{d} {b / 2**20:.1f} MiB" for d, b in r.memory_peak.items()),
                      highlight=False)
    notes = findings(r)
    if notes:
        console.print("[bold]findings[/bold]")
        for note in notes:
            console.print(f"  - {note}", highlight=False)


def report_dict(r: TraceReport) -> dict[str, Any]:
    data = r.to_dict()
    data["findings"] = findings(r)
    return data


def analyze_files(paths: Sequence[Path], as_json: bool, top_k: int, console: Console) -> int:
    """Analyse each file and print the report. Returns 0; raises UserError if any failed."""
    failed = 0
    reports = []
    err = Console(stderr=True)
    for path in paths:
        try:
            report = analyze(read_trace(path), top_k)
        except TraceError as exc:
            err.print(f"[red]error[/red]: {path}: {exc}: {FIXES.get(exc.reason, '')}", highlight=False, soft_wrap=True)
            failed += 1
            continue
        if as_json:
            reports.append(report_dict(report))
        else:
            render_report(report, console)
    if as_json:
        print(json.dumps(reports, indent=2))
    if failed:
        raise UserError(f"{failed} of {len(paths)} trace(s) could not be analysed", "see the error lines above")
    return 0

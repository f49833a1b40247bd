"""The human (rich) and JSON report of analysed traces: ``profagent analyze`` and
``profagent trace`` print it. Works without an agent.

Folders are searched for ``*.json`` and ``*.json.gz`` (recursively). With several traces
the output ends with a cross-rank summary (``analysis/trace/job.py``): per rank, its step
time, compute, communication, idle and overlap; the straggler from the ranks' collectives
(not from step time) and why; warnings when the traces cannot be one job.
``--json`` prints ``{"traces": [...], "summary": {...}}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from profagent.analysis.trace.job import STRAGGLER_THRESHOLD, job_summary, rank_in_file_name
from profagent.analysis.trace.report import readings
from profagent.cli.load import analyse_all
from profagent.contracts import TraceReport
from profagent.errors import UserError
from profagent.labels import printable, shorten

if TYPE_CHECKING:  # rich is imported only when printing tables: `--json` does without it
    from rich.console import Console
    from rich.table import Table

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


FULL_REPORTS_UP_TO = 3  # more traces than this: one row each, unless --details


def trace_rank(r: TraceReport, known: str | None = None) -> str | None:
    """The rank: distributedInfo, else the one the caller knows, else ``rank<N>`` in the name."""
    if r.rank is not None:
        return r.rank
    if known:
        return known
    return rank_in_file_name(Path(r.path).name)


def shown(text: object) -> str:
    """A name from a trace (kernel, op, range, rank, path) as rich markup that shows it:
    control characters escaped (``printable``), brackets not read as markup."""
    from rich.markup import escape

    return escape(printable(str(text)))


def render_report(r: TraceReport, console: Console, rank: str | None = None) -> None:
    """Print one trace's report as rich tables plus findings."""
    from rich.table import Table

    rank = trace_rank(r, rank) or "?"
    device = f", {r.accelerator}" if r.accelerator else ", no accelerator activity"
    console.print(f"\n[bold]{shown(r.path)}[/bold]  rank {shown(rank)}{shown(device)}, {r.bytes / 1e6:.1f} MB of JSON", highlight=False, soft_wrap=True)
    if not r.steps:
        console.print("  no events to analyse in this trace (empty traceEvents)")
        return
    source = {"window": " (no ProfilerStep: whole window)", "optimizer": " (iterations between optimizer steps)"}
    steps = Table(title="steps" + source.get(r.step_source, ""))
    steps.add_column("step")
    steps.add_column("ms", justify="right")
    for s in r.steps:
        steps.add_row(shown(s.name), _ms(s.seconds))
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

    _render_kernels(r, console)
    for title, rows, unit in (("top ops (self CPU time)", r.top_ops, "calls"),
                              ("record_function ranges", r.annotations[:10], "count")):
        if not rows:
            continue
        t = Table(title=title)
        t.add_column("name", overflow="fold", max_width=80)
        t.add_column("ms", justify="right")
        t.add_column(unit, justify="right")
        gpu = unit == "count" and r.annotation_gpu
        if gpu:
            t.add_column("GPU ms launched", justify="right")
        for name, seconds, count in rows:
            extra = (_ms(r.annotation_gpu.get(name)),) if gpu else ()
            t.add_row(shown(shorten(name, 100)), _ms(seconds), str(count), *extra)
        console.print(t)
    if r.memory_peak:
        console.print("peak allocated: " + ", ".join(f"{d} {b / 2**20:.1f} MiB" for d, b in r.memory_peak.items()),
                      highlight=False)
    notes = readings(r)
    if notes:
        console.print("[bold]findings[/bold]")
        for note in notes:
            console.print(f"  - {shown(note)}", highlight=False)


def _render_kernels(r: TraceReport, console: Console) -> None:
    """Top kernels with count, mean, min, max and the op that launched most of them."""
    from rich.table import Table

    if not r.top_kernels:
        return
    stats = {k["name"]: k for k in r.kernel_stats}
    t = Table(title="top kernels (GPU time)")
    t.add_column("name", overflow="fold", max_width=60)
    for column in ("ms", "launches", "mean ms", "min ms", "max ms"):
        t.add_column(column, justify="right")
    t.add_column("launched by", overflow="fold", max_width=30)
    for name, seconds, count in r.top_kernels:
        k = stats.get(name)
        cells = ("-", "-", "-", "-") if k is None else (
            _ms(k["mean"]), _ms(k["min"]), _ms(k["max"]), shown(shorten(k["launched_by"] or "-", 60)))
        t.add_row(shown(shorten(name, 60)), _ms(seconds), str(count), *cells)
    console.print(t)


def report_dict(r: TraceReport, rank: str | None = None) -> dict[str, Any]:
    data = r.to_dict()
    data.pop("in_steps", None)  # profagent diff's totals, not part of the report
    data["rank"] = trace_rank(r, rank)
    data["findings"] = readings(r)
    return data


def expand(paths: Sequence[Path]) -> list[Path]:
    """Files as given; folders replaced by the traces in them (sorted, recursive)."""
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                           and (p.name.endswith(".json") or p.name.endswith(".json.gz")))
            if not found:
                raise UserError(f"no trace (*.json, *.json.gz) in the folder {path}", "pass a folder of torch profiler traces")
            out.extend(found)
        else:
            out.append(path)
    return out


def render_summary(summary: Mapping[str, Any], console: Console) -> None:
    """The per-rank comparison table, the straggler and why, and the job warnings."""
    from rich.table import Table

    t = Table(title="cross-rank summary (shares of step time)")
    for name in ("rank", "traces", "steps", "step ms", "compute", "communication", "idle", "overlap",
                 "collective ms/step"):
        t.add_column(name, justify="left" if name == "rank" else "right")
    straggler = summary["straggler_rank"]
    for rank, row in summary["ranks"].items():
        mark = " [bold red](straggler)[/bold red]" if rank == straggler else ""
        t.add_row(shown(rank) + mark, str(row["traces"]), str(row["steps"]), _ms(row["step_seconds"]),
                  _pct(row["compute"]), _pct(row["communication"]), _pct(row["idle"]), _pct(row["overlap"]),
                  _ms(row["collective_seconds"]))
    console.print(t)
    for warning in summary["warnings"]:
        console.print(f"[bold yellow]warning[/bold yellow]: {shown(warning)}", highlight=False)
    if straggler is not None:
        console.print(f"straggler: rank {shown(straggler)}: {shown(summary['straggler_why'])}", highlight=False)
    else:
        console.print(summary["straggler_why"], highlight=False)
    if summary["spread"] is not None:
        console.print(f"step time spread (slowest / fastest - 1): {summary['spread']:.1%} "
                      "(not used to name the straggler: a synchronous job's ranks share their step time)",
                      highlight=False)


def _render_row(table: Table, r: TraceReport, rank: str | None) -> None:
    g = r.gpu
    table.add_row(shown(Path(r.path).name), shown(rank or "?"), shown(r.accelerator or "-"), str(len(r.steps)),
                  _ms(None if r.steps_inferred else r.step_mean), _pct(None if g is None else g.idle_ratio),
                  str(len(readings(r))))


def analyze_files(paths: Sequence[Path], as_json: bool, top_k: int, console: Console | None,
                  ranks: Mapping[Path, str | None] | None = None, details: bool = False,
                  iteration_window: bool = False, straggler_threshold: float = STRAGGLER_THRESHOLD) -> int:
    """Analyse each file (folders: the traces in them) and print the reports, then a
    cross-rank summary when there are several. Returns 0; raises UserError if any failed.
    ``ranks``: the rank the caller knows for a path (``profagent trace``); ``console``:
    where tables go (None: standard output); ``iteration_window``: the traces were taken
    for N iterations (``profagent trace --iterations N``), so they hold N steps."""
    files = expand(paths)
    failed = 0
    done: list[tuple[TraceReport, str | None]] = []
    if not as_json:
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
    full = details or len(files) <= FULL_REPORTS_UP_TO
    rows = None
    if not as_json and not full:
        rows = Table(title=f"{len(files)} traces (--details for each full report)")
        rows.add_column("trace", overflow="fold")
        for name in ("rank", "accelerator", "steps", "step ms", "GPU idle"):
            rows.add_column(name, no_wrap=True, justify="right")
        rows.add_column("findings", justify="right")  # how many; --details says what
    for path, report in zip(files, analyse_all(files, top_k, iteration_window=iteration_window), strict=True):
        if isinstance(report, tuple):
            from rich.console import Console

            message, reason = report
            Console(stderr=True).print(f"[red]error[/red]: {shown(path)}: {shown(message)}: {FIXES.get(reason, '')}",
                                       highlight=False, soft_wrap=True)
            failed += 1
            continue
        rank = trace_rank(report, (ranks or {}).get(path))
        done.append((report, rank))
        if rows is not None:
            _render_row(rows, report, rank)
        elif not as_json:
            render_report(report, console, rank)
    summary = job_summary(done, straggler_threshold)
    if as_json:
        print(json.dumps({"traces": [report_dict(r, rank) for r, rank in done], "summary": summary}, indent=2))
    else:
        if rows is not None:
            console.print(rows)
        if len(done) > 1:
            render_summary(summary, console)
    if failed:
        raise UserError(f"{failed} of {len(files)} trace(s) could not be analysed", "see the error lines above")
    return 0

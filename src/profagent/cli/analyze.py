"""The human (rich) and JSON report of analysed traces: ``profagent analyze`` and
``profagent trace`` print it. Works without an agent.

Folders are searched for ``*.json`` and ``*.json.gz`` (recursively). With several traces
the output ends with a cross-rank summary: per rank, its step time (the mean over all its
traces' complete steps), the straggler rank (slowest step time) and the spread
(slowest / fastest - 1). ``--json`` prints ``{"traces": [...], "summary": {...}}``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from profagent.analysis.labels import shorten
from profagent.analysis.trace.report import TraceReport, analyze, findings
from profagent.errors import UserError
from profagent.sources.traces.reader import TraceError, read_trace

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
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


def trace_rank(r: TraceReport, known: str | None = None) -> str | None:
    """The rank: distributedInfo, else the one the caller knows, else ``rank<N>`` in the name."""
    if r.rank is not None:
        return r.rank
    if known:
        return known
    m = _RANK_IN_NAME.search(Path(r.path).name)
    return str(int(m.group(1))) if m else None


def render_report(r: TraceReport, console: Console, rank: str | None = None) -> None:
    """Print one trace's report as rich tables plus findings."""
    from rich.table import Table

    rank = trace_rank(r, rank) or "?"
    device = f", {r.accelerator}" if r.accelerator else ", no accelerator activity"
    console.print(f"\n[bold]{r.path}[/bold]  rank {rank}{device}, {r.bytes / 1e6:.1f} MB of JSON", highlight=False, soft_wrap=True)
    if not r.steps:
        console.print("  no events to analyse in this trace (empty traceEvents)")
        return
    source = {"window": " (no ProfilerStep: whole window)", "optimizer": " (iterations between optimizer steps)"}
    steps = Table(title="steps" + source.get(r.step_source, ""))
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


def report_dict(r: TraceReport, rank: str | None = None) -> dict[str, Any]:
    data = r.to_dict()
    data["rank"] = trace_rank(r, rank)
    data["findings"] = findings(r)
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


def cross_rank_summary(reports: Sequence[tuple[TraceReport, str | None]]) -> dict[str, Any]:
    """Per-rank step time, the straggler rank and the spread (see the module doc)."""
    per_rank: dict[str, list[float]] = {}
    traces: dict[str, int] = {}
    for r, rank in reports:
        key = rank if rank is not None else "unknown"
        traces[key] = traces.get(key, 0) + 1
        if not r.steps_inferred:
            per_rank.setdefault(key, []).extend(s.seconds for s in r.steps)
    ranks = {k: {"traces": traces[k], "steps": len(v), "step_seconds": sum(v) / len(v) if v else None}
             for k, v in per_rank.items()}
    for k in traces:
        ranks.setdefault(k, {"traces": traces[k], "steps": 0, "step_seconds": None})
    timed = {k: v["step_seconds"] for k, v in ranks.items() if v["step_seconds"] and k != "unknown"}
    straggler = spread = None
    if len(timed) >= 2:
        straggler = max(timed, key=lambda k: timed[k])
        spread = timed[straggler] / min(timed.values()) - 1
    order = sorted(ranks, key=lambda k: (0, int(k)) if k.isdigit() else (1, k))
    return {"ranks": {k: ranks[k] for k in order}, "straggler_rank": straggler, "spread": spread}


def render_summary(summary: Mapping[str, Any], console: Console) -> None:
    from rich.table import Table

    t = Table(title="cross-rank summary")
    t.add_column("rank")
    t.add_column("traces", justify="right")
    t.add_column("steps", justify="right")
    t.add_column("step ms", justify="right")
    straggler = summary["straggler_rank"]
    for rank, row in summary["ranks"].items():
        mark = " [bold red](straggler)[/bold red]" if rank == straggler else ""
        t.add_row(rank + mark, str(row["traces"]), str(row["steps"]), _ms(row["step_seconds"]))
    console.print(t)
    if straggler is not None:
        console.print(f"straggler: rank {straggler}; spread (slowest / fastest - 1): {summary['spread']:.1%}",
                      highlight=False)
    else:
        console.print("fewer than two ranks with step times: no straggler to name", highlight=False)


def _render_row(table: Table, r: TraceReport, rank: str | None) -> None:
    g = r.gpu
    table.add_row(Path(r.path).name, rank or "?", r.accelerator or "-", str(len(r.steps)),
                  _ms(None if r.steps_inferred else r.step_mean), _pct(None if g is None else g.idle_ratio),
                  str(len(findings(r))))


def analyze_files(paths: Sequence[Path], as_json: bool, top_k: int, console: Console | None,
                  ranks: Mapping[Path, str | None] | None = None, details: bool = False) -> int:
    """Analyse each file (folders: the traces in them) and print the reports, then a
    cross-rank summary when there are several. Returns 0; raises UserError if any failed.
    ``ranks``: the rank the caller knows for a path (``profagent trace``); ``console``:
    where tables go (None: standard output)."""
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
    for path in files:
        try:
            report = analyze(read_trace(path), top_k)
        except TraceError as exc:
            from rich.console import Console

            Console(stderr=True).print(f"[red]error[/red]: {path}: {exc}: {FIXES.get(exc.reason, '')}", highlight=False, soft_wrap=True)
            failed += 1
            continue
        rank = trace_rank(report, (ranks or {}).get(path))
        done.append((report, rank))
        if rows is not None:
            _render_row(rows, report, rank)
        elif not as_json:
            render_report(report, console, rank)
    summary = cross_rank_summary(done)
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

"""``profagent diff BASELINE CURRENT``: two runs side by side and what changed, per step.

Each side is a trace file or a folder of one job's traces (one or more per rank); see
``analysis/trace/diff.py`` for how a side is pooled and what a contributor is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from profagent.analysis.trace.diff import Diff, Side, diff, side, verdict
from profagent.cli.analyze import FIXES, expand, shown, trace_rank
from profagent.cli.load import analyse_all
from profagent.errors import UserError
from profagent.labels import shorten

if TYPE_CHECKING:
    from rich.console import Console

CONTRIBUTORS_SHOWN = 12


def load_side(label: str, path: Path, outcomes: list[Any], files: list[Path]) -> Side:
    """Pool one side's analysed traces; a trace that failed ends the command in one line."""
    reports = []
    for file, outcome in zip(files, outcomes, strict=True):
        if isinstance(outcome, tuple):
            message, reason = outcome
            raise UserError(f"{label} {file}: {message}", FIXES.get(reason, "pass a readable torch profiler trace"))
        reports.append((outcome, trace_rank(outcome)))
    try:
        return side(str(path), reports)
    except ValueError:
        raise UserError(f"{label} {path}: no step to compare in its traces (empty traceEvents)",
                        "pass traces that recorded at least one step") from None


def _files(label: str, path: Path) -> list[Path]:
    if not path.exists():
        raise UserError(f"{label} {path} does not exist", "pass a trace file or a folder of one job's traces")
    return expand([path])


def diff_paths(baseline: Path, current: Path, top_k: int = 10) -> Diff:
    """Read both sides (every trace in parallel processes) and diff them."""
    before, after = _files("baseline", baseline), _files("current", current)
    outcomes = analyse_all(before + after, top_k, in_steps=True)
    return diff(load_side("baseline", baseline, outcomes[: len(before)], before),
                load_side("current", current, outcomes[len(before):], after))


def diff_command(baseline: Path, current: Path, as_json: bool, top_k: int = 10) -> int:
    d = diff_paths(baseline, current, top_k)
    if as_json:
        print(json.dumps(d.to_dict(), indent=2))
        return 0
    from rich.console import Console

    render(d, Console())
    return 0


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.1%}"


def _delta_ms(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{(b - a) * 1e3:+.2f}"


def render(d: Diff, console: Console) -> None:
    from rich.table import Table

    b, c = d.baseline, d.current
    t = Table(title="baseline vs current (per step)")
    for name in ("figure", "baseline", "current", "change"):
        t.add_column(name, justify="left" if name == "figure" else "right")
    t.add_row("traces / ranks / steps", f"{b.traces} / {b.ranks} / {b.steps}", f"{c.traces} / {c.ranks} / {c.steps}", "")
    t.add_row("step time ms", _ms(b.step_mean), _ms(c.step_mean), f"{_delta_ms(b.step_mean, c.step_mean)} ({d.step_ratio:+.1%})")
    t.add_row("steps/s", f"{b.steps_per_second:.2f}", f"{c.steps_per_second:.2f}",
              f"{c.steps_per_second - b.steps_per_second:+.2f}")
    for category in b.categories:
        t.add_row(f"  {category} ms", _ms(b.categories[category]), _ms(c.categories[category]),
                  _delta_ms(b.categories[category], c.categories[category]))
    t.add_row("GPU utilisation", _pct(b.gpu_utilization), _pct(c.gpu_utilization), "")
    t.add_row("GPU idle", _pct(b.gpu_idle), _pct(c.gpu_idle), "")
    for cause in d.idle_delta:
        t.add_row(f"  idle {cause} ms", _ms(b.gpu_idle_causes[cause]), _ms(c.gpu_idle_causes[cause]),
                  _delta_ms(b.gpu_idle_causes[cause], c.gpu_idle_causes[cause]))
    for device in sorted(set(b.memory_peak) | set(c.memory_peak)):
        mib = [None if side.memory_peak.get(device) is None else side.memory_peak[device] / 2**20 for side in (b, c)]
        t.add_row(f"memory peak {shown(device)} MiB", *("-" if v is None else f"{v:.1f}" for v in mib),
                  "" if None in mib else f"{mib[1] - mib[0]:+.1f}")
    console.print(t)

    for kind, title in (("kernel", "top kernels (GPU ms per step)"), ("op", "top ops (self CPU ms per step)")):
        tops = Table(title=title)
        tops.add_column("baseline", overflow="fold", max_width=50)
        tops.add_column("ms", justify="right")
        tops.add_column("current", overflow="fold", max_width=50)
        tops.add_column("ms", justify="right")
        left, right = b.top(kind, 5), c.top(kind, 5)
        for i in range(max(len(left), len(right))):
            cells = []
            for rows in (left, right):
                cells += [shown(shorten(rows[i][0])), _ms(rows[i][1])] if i < len(rows) else ["", ""]
            tops.add_row(*cells)
        console.print(tops)

    ranked = Table(title="what changed, by contribution to the step time (ms per step)")
    ranked.add_column("kind")
    ranked.add_column("name", overflow="fold", max_width=70)
    ranked.add_column("delta ms", justify="right")
    for row in d.contributors[:CONTRIBUTORS_SHOWN]:
        ranked.add_row(row["kind"], shown(shorten(row["name"])), f"{row['delta'] * 1e3:+.3f}")
    console.print(ranked)
    for title, rows in (("appeared", d.appeared), ("vanished", d.vanished)):
        if rows:
            console.print(f"{title}: " + "; ".join(f"{r['kind']} {shown(shorten(r['name']))} ({_ms(r['seconds'])} ms)"
                                                   for r in rows[:5]), highlight=False)
    for w in (*b.warnings, *c.warnings):
        console.print(f"warning: {shown(w)}", highlight=False)
    console.print(f"[bold]verdict[/bold]: {shown(verdict(d))}", highlight=False)

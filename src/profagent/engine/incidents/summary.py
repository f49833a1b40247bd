"""An incident's first page, ``summary.md``: what the trigger says now, which rank and
which line (from the bundle's own stacks), every rank's and DataLoader worker's line, the
evidence, the files and the notes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Protocol

from profagent.analysis.collectives import parse_dump_text
from profagent.analysis.incidents import Trigger
from profagent.analysis.stacks import innermost_frame, own_frame
from profagent.contracts import ProcessInfo
from profagent.engine.incidents.bundle import TIMELINE, worker_stacks_file
from profagent.system.safefs import read_nofollow


class Captured(Protocol):
    """What the summary reads of a capture (``capture.Capture``)."""

    trigger: Trigger
    folder: Path
    now: float
    ranks: list[ProcessInfo]
    workers: list[ProcessInfo]
    stacks: dict[str, str]  # rank -> dump text
    files: list[str]
    notes: list[str]
    updated: float | None
    first_reason: str


def summary_text(capture: Captured) -> str:
    """The first page: what the trigger says now, and the culprit's line from this
    bundle's own stacks (never from the tick the capture started on)."""
    t = capture.trigger
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(capture.now))
    by_rank = {p.rank: p for p in capture.ranks}
    rank = t.rank if t.rank in by_rank else None
    culprits = [r for r in (str(c) for c in t.evidence.get("culprit_ranks") or ()) if r in by_rank]
    where = innermost_frame(capture.stacks.get(rank, "")) if rank is not None else None
    title = {"hang": "a rank hangs", "regression": "step time regressed", "manual": "capture on request"}[t.kind]
    if rank in by_rank:
        which = f"rank {rank} (PID {by_rank[rank].pid})"
        own = own_line(capture.stacks.get(rank, ""))
        line = (f"`{own}` (its own code), in `{where}` (innermost Python frame of its main thread)"
                if own and where and own != where
                else f"`{where}` (innermost Python frame of its main thread)" if where else "unknown (no stacks)")
    else:
        which = f"rank {t.rank} (not on this node)" if t.rank is not None else "the whole job"
        line = "unknown (no stacks of that rank)" if t.rank is not None else "each rank's below"
    lines = [f"# Incident {capture.folder.name}: {title} (job {t.job_id})", "",
             f"- **What happened**: {t.reason}", f"- **When**: {when}"]
    if capture.updated is not None:
        lines.append(f"- **Updated**: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(capture.updated))}, "
                     f"when the finding changed (it first said: {capture.first_reason})")
    lines += [f"- **Which rank**: {which}", f"- **Which line**: {line}"]
    if t.evidence.get("advice"):
        lines.append(f"- **What to do**: {t.evidence['advice']}")
    for other in culprits:
        if other != rank:
            frame = innermost_frame(capture.stacks.get(other, ""))
            lines.append(f"- **Also culprit**: rank {other} (PID {by_rank[other].pid}) at {f'`{frame}`' if frame else 'an unknown line'}")
    lines += ["", "## Every rank", "",
              "| rank | PID | its own line (main thread) | innermost Python frame of the main thread |",
              "| --- | --- | --- | --- |"]
    for p in capture.ranks:
        dump = capture.stacks.get(p.rank, "")
        frame, own = innermost_frame(dump), own_line(dump)
        lines.append(f"| {p.rank} | {p.pid} | {f'`{own}`' if own else '-'} | {f'`{frame}`' if frame else '-'} |")
    if capture.workers:
        lines += ["", "## DataLoader workers", "", "| rank | PID | its own line | file |", "| --- | --- | --- | --- |"]
        for p in capture.workers:
            lines.append(f"| {p.rank} | {p.pid} | {_worker_line(capture.folder, p)} | "
                         f"`{worker_stacks_file(p.rank, p.pid)}` |")
    evidence = dict(t.evidence)
    if evidence:
        lines += ["", "## Evidence", "", "```json", json.dumps(evidence, indent=2, default=str), "```"]
    lines += ["", "## Files", ""] + [f"- `{name}`" + (" (every rank's steps of the minutes before: open it at "
                                                       "https://ui.perfetto.dev or in chrome://tracing)"
                                                       if name == TIMELINE else "") for name in sorted(capture.files)]
    if capture.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in capture.notes]
    return "\n".join(lines) + "\n"


def own_line(dump: str) -> str | None:
    """``function (file.py:line)`` of the main thread's innermost frame of the job's own code
    (not the standard library's, torch's or another framework's) in a py-spy text dump."""
    threads = parse_dump_text(dump)
    main = next((t for t in threads if t.name == "MainThread"), threads[0] if threads else None)
    frame = own_frame(main.frames) if main is not None else None
    return str(frame) if frame is not None else None


def _worker_line(folder: Path, p: ProcessInfo) -> str:
    try:
        dump = read_nofollow(folder / worker_stacks_file(p.rank, p.pid)).decode(errors="replace")
    except OSError:
        return "-"
    own = own_line(dump)
    return f"`{own}`" if own else "-"

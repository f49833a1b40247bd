"""Ground truth of tests/workloads/plain_ddp.py: each rank's own log, and its event trigger."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def rank_events(log_dir: Path, rank: int) -> list[dict]:
    """Rank ``rank``'s events, one JSON object a line (a line still being written is left out)."""
    path = log_dir / f"rank{rank}.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def trigger_event(trigger: Path, steps: Sequence[Sequence[dict]], kind: str, ahead_seconds: float = 5.0) -> int:
    """Every rank takes ``kind`` at a step none has reached: about ``ahead_seconds`` of steps
    on, 20 at least (``steps``: each rank's "step" events). A rank takes the event at that
    step only, so a step it has passed by then is never taken: at 12 ms a step (seen beside
    stress-ng) a fixed 20 steps were gone while the logs were still being read."""
    recent = [s[-200:] for s in steps]
    rate = max((r[-1]["step"] - r[0]["step"]) / max(r[-1]["time"] - r[0]["time"], 1e-3) for r in recent)
    step = max(s[-1]["step"] for s in steps) + max(20, int(rate * ahead_seconds))
    tmp = trigger.with_suffix(".tmp")
    tmp.write_text(f"{kind}:{step}\n")
    tmp.rename(trigger)
    return step

"""GET /api/findings: every job's active findings and probed steps, from the findings snapshots."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import orjson

from profagent.analysis.findings.evaluate import sort_key
from profagent.contracts import FindingsSnapshot, RankSteps
from profagent.exporters.http import Route


def step_row(r: RankSteps) -> dict[str, object]:
    """One rank's steps from the kernel probes, as /api/findings gives them (diagnose)."""
    return {"job_id": r.job_id, "rank": r.rank, "p50_seconds": r.p50, "p90_seconds": r.p90, "max_seconds": r.max,
            "steps_per_second": r.steps_per_second, "micro_batches": r.micro_batches,
            "stage_shares": dict(r.stage_shares), "window_steps": r.window_steps,
            "step_boundary": r.step_boundary or None, "steps_note": r.steps_note or None}


def findings_route(snapshots: Callable[[], Sequence[FindingsSnapshot | None]]) -> Route:
    """GET /api/findings[?job=J] -> {"findings": [...], "time": t} over every job's latest snapshot.

    ``snapshots`` gives one entry per job whose findings engine runs (None until its first
    tick), and nothing when the engine is off (503)."""

    def route(query: dict[str, list[str]]) -> tuple[int, str, bytes]:
        job = (query.get("job") or [None])[0]
        taken = [s for s in snapshots() if s is not None]
        if not taken and not snapshots():
            return 503, "text/plain", b"the findings engine is off (findings.enabled = false)\n"
        rows = sorted((f for s in taken for f in s.findings if job in (None, f.job_id)), key=sort_key)
        steps = [step_row(r) for s in taken for r in s.steps if job in (None, r.job_id)]
        body = {"findings": [f.as_dict() for f in rows], "time": max((s.time for s in taken), default=0.0),
                "evaluations": sum(s.evaluations for s in taken), "steps": steps}
        return 200, "application/json", orjson.dumps(body)

    return route

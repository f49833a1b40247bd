"""Findings that hold steady: a finding judged from a window of stack samples stays
active for ``findings.hold_seconds`` after its evidence was last seen.

A straggler or a ``*_bound`` rank sits on its threshold as often as not (a wait share of
0.36 against a line at 0.365): raised and cleared every few ticks, the finding was active
in a fifth to a half of the polls, and an alert rule with ``for:`` never fired. Held, it
clears only once its evidence has been gone for the hold: a cause that is clearly gone.

Never held: a finding of a job with a hang (found or suspected: a stalled rank waits least
of all, and the straggler's evidence is then the hang's), and one of a rank or job no
longer measured (it ended). Pure: the caller passes ``now``.
"""

from __future__ import annotations

from collections.abc import Iterable

from profagent.contracts import Finding

# Judged from a window of stack samples or traces, and prone to sit on their line.
HELD_KINDS = frozenset({"straggler", "dataloader_bound", "host_sync_bound", "optimizer_bound", "compile_storm"})


class Steady:
    """Keeps each held kind's finding ``hold_seconds`` after its last sighting."""

    def __init__(self, hold_seconds: float, kinds: frozenset[str] = HELD_KINDS) -> None:
        self.hold_seconds = hold_seconds
        self.kinds = kinds
        self._seen: dict[tuple[str, str, str], tuple[Finding, float]] = {}  # key -> (last finding, when)

    def __call__(self, found: list[Finding], now: float, measured: Iterable[tuple[str, str]],
                 quiet_jobs: Iterable[str] = ()) -> list[Finding]:
        """``found`` plus the held findings not in it. ``measured``: (job, rank) still
        observed; ``quiet_jobs``: jobs with a hang, found or suspected."""
        quiet, live = set(quiet_jobs), set(measured)
        live_jobs = {job for job, _ in live}
        for f in found:
            if f.finding in self.kinds:
                self._seen[f.key] = (f, now)
        current = {f.key for f in found}
        out = list(found)
        for key, (f, seen) in list(self._seen.items()):
            gone = (now - seen >= self.hold_seconds or f.job_id in quiet
                    or (f.rank is not None and (f.job_id, f.rank) not in live) or f.job_id not in live_jobs)
            if gone:
                del self._seen[key]
            elif key not in current:
                out.append(f)
        return out

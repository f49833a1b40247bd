"""Findings that hold steady: held ``findings.hold_seconds`` after their evidence was last
seen, and a straggler raised only once its evidence lasted ``findings.straggler_confirm_seconds``.

Why: a rank on its threshold would otherwise flap, and an alert with ``for:`` never fire.
Pure: the caller passes ``now``.
"""

from __future__ import annotations

from collections.abc import Iterable

from profagent.contracts import Finding, FindingKind

# The kinds held are declared by their modules (``WINDOW_HELD``, gathered in evaluate.py).
CONFIRMED_KINDS: frozenset[FindingKind] = frozenset({"straggler"})


# Held: a finding judged from a window of stack samples. A straggler or a ``*_bound`` rank
# sits on its threshold as often as not (a wait share of 0.36 against a line at 0.365): raised and cleared every few ticks, the finding was active
# in a fifth to a half of the polls, and an alert rule with ``for:`` never fired. Held, it
# clears only once its evidence has been gone for the hold: a cause that is clearly gone.
#
# Confirmed first: a straggler's evidence at every evaluation for the confirm time. A healthy
# rank on a loaded node arrived last at 63% of its node's collectives (the line is 60%) for
# one evaluation early in a run; held, that one evaluation was a minute of straggler. A real
# straggler's evidence lasts (91% against the same line).
#
# Never held: a finding of a job with a hang (found, or a rank frozen for 30 s, or its steps
# stopped: a stalled rank waits least of all, and the straggler's evidence is then the
# hang's), and one of a rank or job no longer measured (it ended).
class Steady:
    """Keeps each held kind's finding ``hold_seconds`` after its last sighting; a confirmed
    kind's finding appears only once it was found at every evaluation for ``confirm_seconds``."""

    def __init__(self, hold_seconds: float, kinds: frozenset[FindingKind], confirm_seconds: float = 0.0,
                 confirmed: frozenset[FindingKind] = CONFIRMED_KINDS) -> None:
        self.hold_seconds = hold_seconds
        self.kinds = kinds
        self.confirm_seconds = confirm_seconds
        self.confirmed = confirmed
        self._seen: dict[tuple[str, str, str], tuple[Finding, float]] = {}  # key -> (last finding, when)
        self._first: dict[tuple[str, str, str], float] = {}  # key -> start of its unbroken run of evaluations

    def __call__(self, found: list[Finding], now: float, measured: Iterable[tuple[str, str]],
                 quiet_jobs: Iterable[str] = ()) -> list[Finding]:
        """``found`` plus the held findings not in it. ``measured``: (job, rank) still
        observed; ``quiet_jobs``: jobs with a hang, found or likely (the caller decides)."""
        quiet, live = set(quiet_jobs), set(measured)
        live_jobs = {job for job, _ in live}
        found = self._confirm(found, now)
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

    def _confirm(self, found: list[Finding], now: float) -> list[Finding]:
        """``found`` without the confirmed kinds' findings whose evidence is younger than
        ``confirm_seconds`` (one already held stays: its run was confirmed)."""
        keys = {f.key for f in found if f.finding in self.confirmed}
        self._first = {k: v for k, v in self._first.items() if k in keys}
        out = []
        for f in found:
            if f.finding in self.confirmed:
                began = self._first.setdefault(f.key, now)
                if now - began < self.confirm_seconds and f.key not in self._seen:
                    continue
            out.append(f)
        return out

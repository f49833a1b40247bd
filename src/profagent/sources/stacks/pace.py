"""How fast each sampled process is looked at: the stacks source's pace policy.

The full rate (``stacks.rate`` in ``stacks.window`` windows) while a process warms up,
while its job has a finding or a stall suspected, and while someone watches the job's
stacks; the steady rate otherwise. py-spy's cost is mostly per window and per sample.
"""

from __future__ import annotations

from collections.abc import Callable

from profagent.config import StacksConfig

WATCH_HOLD = 30.0  # seconds of full rate after `profagent top` or /api/stacks last asked


class PacePolicy:
    def __init__(self) -> None:
        self._first_seen: dict[int, float] = {}  # pid -> when it was first wanted
        self._watched_until = float("-inf")

    def watched(self, now: float) -> None:
        """Someone looks at the stacks (`profagent top`, /api/stacks): full rate a while."""
        self._watched_until = now + WATCH_HOLD

    def pace(self, config: StacksConfig, pids: list[int], job_of: Callable[[int], str], suspects: set[str],
             hot: Callable[[str], bool], now: float) -> dict[int, tuple[int, float]]:
        """Each process' next windows, (rate, seconds). ``suspects``: the jobs with a rank
        whose stack stood still in its last window: every rank of such a job goes to the
        full rate, so the hang verdict reads each rank as it is now, not from a long steady
        window."""
        cfg = config
        self._first_seen = {pid: self._first_seen.get(pid, now) for pid in pids}
        full, steady = (cfg.rate, cfg.window), (cfg.steady_rate, cfg.steady_window)
        if cfg.steady_rate <= 0 or now < self._watched_until:
            return dict.fromkeys(pids, full)
        pace = {}
        for pid in pids:
            job = job_of(pid)
            pace[pid] = full if (now - self._first_seen[pid] < cfg.warmup_seconds or job in suspects
                                 or hot(job)) else steady
        return pace

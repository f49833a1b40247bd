"""The stacks source's stall policy: does each rank's main thread stand still, and the
DataLoader workers it waits for?

Each main-thread window updates the rank's ``StallTracker``; the rank's state (stalled,
seconds unchanged, its most sampled stack) drives the pace (a suspected stall: the job at
the full rate), the native-window requests and the ``RankStall`` of the snapshot, which
the hang finding reads. A rank waiting for its DataLoader has its workers sampled too: a
worker that stands still making a batch holds the rank up.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from functools import cached_property

from profagent.analysis.collectives import in_collective
from profagent.analysis.stacks import (
    Sample,
    StallTracker,
    dominant_stack,
    fetching,
    standing_key,
    waits_on_dataloader,
)
from profagent.config import StacksConfig
from profagent.contracts import ROLE_DATALOADER, Frame, ProcessInfo, RankStall, WorkerStall

log = logging.getLogger(__name__)

# A rank whose last window began before another rank of its job stalled is shown as it was
# before the job stopped: the hang verdict waits for its next window, this long at most past
# the longest window (py-spy start-up and harvest, longer on a loaded node)
STALE_GRACE = 15.0

RankKey = tuple[str, str]  # (job_id, rank)


@dataclass(frozen=True)
class WorkerLook:
    """The last window of one DataLoader worker: its stall tracker, most sampled stack, and
    whether it stands still making a batch."""

    tracker: StallTracker
    frames: tuple[Frame, ...] = ()
    stuck: bool = False
    unchanged: float = 0.0


@dataclass(frozen=True)
class NativeLook:
    """What a native window saw of a rank's main thread: its most sampled stack (with and
    without native frames), whether the thread moved, when it was read (clock) and when its
    window began."""

    python: tuple[Frame, ...]
    frames: tuple[Frame, ...]
    moving: bool
    at: float
    start: float = float("-inf")

    @cached_property
    def waits_in_collective(self) -> bool:
        """Its frames wait in a collective (asked at every snapshot: computed once)."""
        return in_collective(self.frames)


class StallPolicy:
    def __init__(self) -> None:
        self.trackers: dict[RankKey, StallTracker] = {}
        self.state: dict[RankKey, tuple[bool, float, tuple[Frame, ...]]] = {}  # stalled, unchanged s, stack
        self.looked: dict[RankKey, tuple[float, float]] = {}  # (start, end) of its last main window
        # DataLoader workers of ranks waiting for their DataLoader: (job_id, rank) -> pid -> look
        self.workers: dict[RankKey, dict[int, WorkerLook]] = {}
        self.worker_pids: dict[RankKey, set[int]] = {}  # the workers sampled now
        self.rank_workers: dict[RankKey, set[int]] = {}  # every DataLoader worker of each rank

    def forget(self, live_jobs: set[str], expired: Collection[tuple[str, str]] = frozenset()) -> None:
        """Drop the ranks of jobs that are gone, and the (job, rank) pairs in ``expired``."""
        for table in (self.trackers, self.state, self.looked, self.workers, self.worker_pids):
            for key in [k for k in table if k[0] not in live_jobs or (k[0], k[1]) in expired]:
                del table[key]

    def suspects(self) -> set[str]:
        """The jobs with a rank whose last window had one unchanged stack."""
        return {job for (job, _), state in self.state.items() if state[1] > 0}

    def workers_to_sample(self, processes: Iterable[ProcessInfo]) -> dict[int, tuple[str, str]]:
        """pid -> (rank, role) of the workers of every rank whose main thread stands still
        waiting for its DataLoader: a worker that hangs holds the rank up, and only its own
        stack says where."""
        waiting = {key for key, (_, unchanged, frames) in self.state.items()
                   if unchanged > 0 and waits_on_dataloader(frames)}
        wanted: dict[int, tuple[str, str]] = {}
        self.worker_pids, self.rank_workers = {}, {}
        for p in processes:
            if p.role == ROLE_DATALOADER:
                self.rank_workers.setdefault((p.job_id, p.rank), set()).add(p.pid)
            if p.role == ROLE_DATALOADER and (p.job_id, p.rank) in waiting:
                wanted[p.pid] = (p.rank, p.role)
                self.worker_pids.setdefault((p.job_id, p.rank), set()).add(p.pid)
        for key in list(self.workers):
            live = self.worker_pids.get(key, set())
            self.workers[key] = {pid: look for pid, look in self.workers[key].items() if pid in live}
        return wanted

    def check_rank(self, key: RankKey, main: list[Sample], start: float, end: float, busy: bool | None,
                   stall_seconds: float) -> None:
        """One window of a rank's main process; ``busy`` as ``StallTracker.update`` takes it."""
        tracker = self.trackers.setdefault(key, StallTracker(stall_seconds))
        status = tracker.update(main, start, end, busy)
        self.looked[key] = (start, end)
        was = self.state.get(key, (False, 0.0, ()))[0]
        self.state[key] = (status.stalled, status.unchanged_seconds, dominant_stack(main))
        if status.started:
            gpu = "no GPU signal" if busy is None else "its GPUs idle"  # False comes from the GPUs alone
            log.warning("rank %s stalled: main thread stack unchanged for %.0f s (%s); stack, innermost last:",
                        key[1], status.unchanged_seconds, gpu, extra={"lines": [str(f) for f in status.frames]})
        elif was and not status.stalled:
            log.info("rank %s is moving again", key[1])

    def check_worker(self, key: RankKey, pid: int, main: list[Sample], start: float, end: float,
                     stall_seconds: float) -> None:
        """One window of a DataLoader worker: does it stand still while it makes a batch?"""
        if pid not in self.worker_pids.get(key, set()):
            return  # sampled for config.stacks.dataloader only, or its rank moved on
        looks = self.workers.setdefault(key, {})
        look = looks.get(pid) or WorkerLook(StallTracker(stall_seconds))
        status = look.tracker.update(main, start, end, None)
        frames = dominant_stack(main)
        stuck = status.unchanged_seconds > 0 and fetching(frames)
        if stuck and not look.stuck:
            log.warning("rank %s: DataLoader worker PID %d stands still while making a batch; stack, innermost last:",
                        key[1], pid, extra={"lines": [str(f) for f in frames]})
        looks[pid] = WorkerLook(look.tracker, frames, stuck, status.unchanged_seconds)

    def look_holds(self, key: RankKey, look: NativeLook) -> bool:
        """Whether a native look says where the rank stands now: its window lies within the
        stack's current standing run, or it caught the rank already waiting in a collective
        (blocked during the window). A window that began before the run and shows the rank
        computing is from before it stopped (it stepped, then blocked late in the window)."""
        tracker = self.trackers.get(key)
        since = tracker.since if tracker is not None else None
        return since is None or look.start >= since or look.waits_in_collective

    def rank_stalls(self, config: StacksConfig, native: dict[RankKey, NativeLook], native_pending: set[RankKey],
                    now: float) -> tuple[RankStall, ...]:
        """Every rank's ``RankStall`` for the snapshot, stale ones marked."""
        return self._mark_stale(config, [self._rank_stall(config, key, native.get(key), key in native_pending, now, *state)
                                         for key, state in sorted(self.state.items())], now)

    def _rank_stall(self, config: StacksConfig, key: RankKey, look: NativeLook | None, pending_native: bool, now: float,
                    stalled: bool, unchanged: float, frames: tuple[Frame, ...]) -> RankStall:
        same = look is not None and bool(frames) and standing_key(look.python) == standing_key(frames)
        # its native frames, only from a look that says where it stands now (look_holds)
        holds = same and look is not None and self.look_holds(key, look)
        # native frames that moved (outside any collective) under this stack: the rank computes
        # in one long C++ call (a slow backward), it is not stuck. A look from before the stack
        # stood still says the same for stall_seconds at most (the next look is asked after
        # half of it): the rank may compute still (a straggler's backward) or have blocked
        # since; not known yet
        moving = same and look is not None and look.moving and (holds or now - look.at <= config.stall_seconds)
        waiting = unchanged > 0 and waits_on_dataloader(frames)
        workers = tuple(WorkerStall(pid, w.stuck, w.unchanged, w.frames)
                        for pid, w in sorted(self.workers.get(key, {}).items())) if waiting else ()
        # its workers' first windows are on their way (asked for at the next collect); not for
        # ever: a worker py-spy cannot read must not hold the verdict back
        pending = (waiting and unchanged < config.stall_seconds + 2 * STALE_GRACE
                   and any(pid not in self.workers.get(key, {}) for pid in self.rank_workers.get(key, ())))
        # a rank waiting for a worker that stands still is stalled, whatever its poll loop does
        held = any(w.stuck and w.unchanged_seconds > config.stall_seconds for w in workers)
        return RankStall(key[1], (stalled and not moving) or held, unchanged, key[0], frames,
                         suspected=unchanged > 0 and not moving, native=look.frames if holds and look else (),
                         native_pending=pending_native, workers=workers, workers_pending=pending,
                         window_age_seconds=max(0.0, now - self.looked.get(key, (now, 0.0))[0]))

    def _mark_stale(self, config: StacksConfig, stalls: list[RankStall], now: float) -> tuple[RankStall, ...]:
        """Mark the ranks whose last window began before another rank of their job stalled
        (``RankStall.stale``), while a newer window may still come."""
        longest = max(config.window, config.steady_window if config.steady_rate > 0 else 0.0)
        began: dict[str, float] = {}  # job -> when its earliest stalled rank's stack stood still
        for s in stalls:
            if s.stalled:
                since = self.looked[(s.job_id, s.rank)][1] - s.unchanged_seconds
                began[s.job_id] = min(began.get(s.job_id, since), since)
        marked = []
        for s in stalls:
            start, end = self.looked.get((s.job_id, s.rank), (now, now))
            stale = (not s.stalled and s.job_id in began and start < began[s.job_id]
                     and now - end < longest + STALE_GRACE)
            marked.append(dataclasses.replace(s, stale=True) if stale else s)
        return tuple(marked)

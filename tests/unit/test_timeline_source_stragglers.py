"""The timeline source (sources/timeline/source.py), with an injected clock: the arrival
straggler per job, summarised from the window's matched collectives at most every
STRAGGLER_EVERY seconds and forgotten with its job; a flooding process's events shed."""

from __future__ import annotations

from collections import deque

from profagent.analysis.timeline import Arrival
from profagent.config import TimelineConfig
from profagent.sources.timeline.source import STRAGGLER_EVERY, TimelineSource


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def arrivals(last: str, steps: range) -> list[Arrival]:
    """One collective a step; ``last`` arrives 5 ms after the other rank."""
    return [Arrival(float(s), 0, {"0": s + (0.005 if last == "0" else 0.0), "1": s + (0.005 if last == "1" else 0.0)})
            for s in steps]


def test_a_jobs_straggler_is_summarised_at_most_every_few_seconds_then_forgotten_with_the_job() -> None:
    clock = Clock()
    source = TimelineSource(TimelineConfig(window_seconds=60.0), interval=0.5, clock=clock)
    source._arrivals["job"] = deque(arrivals("1", range(950, 1000)))
    [first] = source._stragglers(clock())
    assert (first.job_id, first.rank, first.last_share, first.collectives) == ("job", "1", 1.0, 50)

    # rank 0 now arrives last far more often: not read again before STRAGGLER_EVERY
    source._arrivals["job"].extend(arrivals("0", range(1000, 1100)))
    clock.t += STRAGGLER_EVERY / 2
    assert source._stragglers(clock()) == (first,)
    clock.t += STRAGGLER_EVERY / 2
    [now] = source._stragglers(clock())
    # the window (60 s back from 1002) holds every step since 950: 50 with rank 1 last, 100 with rank 0
    assert (now.rank, now.collectives, round(now.last_share, 3)) == ("0", 150, round(100 / 150, 3))

    del source._arrivals["job"]
    assert source._stragglers(clock()) == () and source._straggler_at == {}


def test_a_flooding_process_is_shed_for_a_while_and_its_rank_says_so() -> None:
    """A process over timeline.flood_events a second is shed for SHED_SECONDS; the events it sends
    meanwhile are counted against its rank; a process below the rate never is."""
    from types import SimpleNamespace

    from profagent.sources.timeline.source import JUDGE_EVERY, SHED_SECONDS, _Rank, _steps_note

    clock = Clock()
    source = TimelineSource(TimelineConfig(), interval=0.5, clock=clock)
    flood = source.config.flood_events
    source._ranks[7] = _Rank("nobody's", "0")
    reader = SimpleNamespace(counts={})
    clock.t += JUDGE_EVERY / 2
    reader.counts = {7: 10 * flood, 8: 500}
    source._judge_floods(reader)  # too soon: not judged yet
    assert source._shed == {} and reader.counts
    clock.t += JUDGE_EVERY / 2
    source._judge_floods(reader)
    assert set(source._shed) == {7} and reader.counts == {}
    reader.counts = {7: 3 * flood, 8: flood // 2}
    clock.t += 2.0
    source._judge_floods(reader)  # still over: shed on, and these counted as shed
    assert set(source._shed) == {7} and source._shed_events == {7: 3 * flood}
    reader.counts = {7: 10}
    clock.t += SHED_SECONDS + 1
    source._judge_floods(reader)  # quiet, and its time is up (what it sent meanwhile was shed)
    assert source._shed == {} and source._shed_events == {7: 3 * flood + 10}
    note = _steps_note("optimizer", source._shed_events[7], flood)
    assert note.startswith(f"{3 * flood + 10} of its probe events were shed") and "capture_profiler" not in note
    assert "capture_profiler_record_function" in _steps_note("backward", 0, flood)

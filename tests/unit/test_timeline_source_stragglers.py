"""The timeline source and the arrival straggler to the finding (sources/timeline/source.py,
analysis/timeline.py, analysis/findings/steps.py), with an injected clock: synthetic steps
of plain DDP, of an HF ``Trainer``-like job (a collective that re-aligns the ranks at each
step's start, then ten DDP buckets), and of healthy noisy jobs, fed tick by tick through the
source's matching and summary into the evaluator that confirms and holds the finding; the
straggler summarised at most every STRAGGLER_EVERY seconds and forgotten with its job; a
flooding process's events shed."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from profagent.analysis import timeline as tl
from profagent.analysis.findings.evaluate import Evaluator
from profagent.config import FindingsConfig, TimelineConfig
from profagent.contracts import Finding, TimelineSnapshot
from profagent.sources.timeline.source import STEPS_KEPT, STRAGGLER_EVERY, TimelineSource, _Rank

TICK = 0.5  # the agent's interval


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def arrivals(last: str, steps: range) -> list[tl.Arrival]:
    """One collective a step; ``last`` arrives 5 ms after the other rank."""
    return [tl.Arrival(float(s), 0, {"0": s + (0.005 if last == "0" else 0.0), "1": s + (0.005 if last == "1" else 0.0)})
            for s in steps]


def test_a_jobs_straggler_is_summarised_at_most_every_few_seconds_then_forgotten_with_the_job() -> None:
    clock = Clock()
    source = TimelineSource(TimelineConfig(window_seconds=60.0), interval=0.5, clock=clock)
    source._arrivals["job"] = tl.ArrivalWindow(STEPS_KEPT)
    source._arrivals["job"].extend(tl.fold_steps(arrivals("1", range(950, 1000))))
    [first] = source._stragglers(clock())
    assert (first.job_id, first.rank, first.last_share, first.step_last_share, first.collectives, first.steps) \
        == ("job", "1", 1.0, 1.0, 50, 50)

    # rank 0 now arrives last far more often: not read again before STRAGGLER_EVERY
    source._arrivals["job"].extend(tl.fold_steps(arrivals("0", range(1000, 1100))))
    clock.t += STRAGGLER_EVERY / 2
    assert source._stragglers(clock()) == (first,)
    clock.t += STRAGGLER_EVERY / 2
    [now] = source._stragglers(clock())
    # the window (60 s back from 1002) holds every step since 950: 50 with rank 1 last, 100 with rank 0
    assert (now.rank, now.collectives, round(now.step_last_share, 3)) == ("0", 150, round(100 / 150, 3))

    del source._arrivals["job"]
    assert source._stragglers(clock()) == () and source._straggler_at == {}


# -- synthetic jobs ------------------------------------------------------------------------

@dataclass
class Job:
    """A synchronous job's steps as each rank's probes would time them. Each step: the
    optimizer (``opt``), the DataLoader wait, host work, then (``sync``) one collective every
    rank calls before its forward, as HF ``Trainer``'s gather of the batch's item count, which
    returns once the last rank called it; the forward; the backward with ``buckets`` DDP
    bucket collectives, ending on every rank once the last rank's last bucket is reduced.
    The slow rank takes ``extra`` seconds more ``where``: "data" (its DataLoader), "host" (host
    work before the sync) or "compute" (forward and backward, ``extra`` in all)."""

    ranks: int = 2
    sync: bool = False
    buckets: int = 10
    data: float = 0.004
    host: float = 0.002
    forward: float = 0.012
    backward: float = 0.016
    opt: float = 0.003
    jitter: float = 0.0005  # uniform, per rank and stage: who is last at an equal collective is a coin toss
    slow: str | None = None
    extra: float = 0.0
    where: str = "compute"
    seed: int = 0
    t: float = 0.0
    steps: dict[str, list[tl.Step]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.steps = {str(r): [] for r in range(self.ranks)}

    def j(self, x: float) -> float:
        return x + self.rng.uniform(0.0, self.jitter)

    def step(self) -> None:
        names = list(self.steps)
        start = {r: self.t + self.rng.uniform(0.0, 5e-5) for r in names}
        late = {r: (self.extra if r == self.slow else 0.0) for r in names}
        opt_end = {r: start[r] + self.j(self.opt) for r in names}
        data = {r: self.j(self.data) + (late[r] if self.where == "data" else 0.0) for r in names}
        ready = {r: opt_end[r] + data[r] + self.j(self.host) + (late[r] if self.where == "host" else 0.0) for r in names}
        calls: dict[str, list[float]] = {r: [] for r in names}
        if self.sync:
            for r in names:
                calls[r].append(ready[r])
            met = max(ready.values()) + 1e-4
            ready = {r: met + self.rng.uniform(0.0, 5e-5) for r in names}
        compute = {r: late[r] if self.where == "compute" else 0.0 for r in names}
        bwd_start = {r: ready[r] + self.j(self.forward) + compute[r] / 2 for r in names}
        bwd_len = {r: self.j(self.backward) + compute[r] / 2 for r in names}
        for r in names:
            for k in range(self.buckets):
                calls[r].append(bwd_start[r] + bwd_len[r] * (k + 1) / (self.buckets + 1) + self.rng.uniform(0.0, self.jitter))
        end = max(max(c) for c in calls.values()) + bwd_len[names[0]] / (self.buckets + 1)
        for r in names:
            seconds = end - start[r]
            stages = {"data_wait": data[r], "backward": end - bwd_start[r], "optimizer": opt_end[r] - start[r]}
            stages["other"] = seconds - sum(stages.values())
            self.steps[r].append(tl.Step(start[r], seconds, stages, 1, tuple(calls[r])))
        self.t = end


class Pipeline:
    """The source's matching and summary, the evaluator's confirmation and hold, at each tick
    of an injected clock; the job's steps reach the source as they end."""

    def __init__(self, job: Job, window: float = 60.0, **findings: float) -> None:
        self.job = job
        self.clock = Clock()
        self.clock.t = job.t = 1000.0
        self.source = TimelineSource(TimelineConfig(window_seconds=window), interval=TICK, clock=self.clock)
        for i, rank in enumerate(job.steps):
            self.source._ranks[100 + i] = _Rank("job", rank)
        self.evaluator = Evaluator(FindingsConfig(**findings))  # type: ignore[arg-type]

    def tick(self) -> list[Finding]:
        self.clock.t += TICK
        while self.job.t < self.clock.t:
            self.job.step()
        for r in self.source._ranks.values():
            t, steps = r.timeline, self.job.steps[r.rank]
            t.recent.extend(steps[t.optimizer_steps:])
            t.optimizer_steps = t.steps_total = len(steps)  # as RankTimeline counts what it appends
            t.last_event = t.last_step = self.job.t
        now = self.clock()
        self.source._match(now)
        snapshot = TimelineSnapshot(tuple(self.source._rank_steps(pid, r, now) for pid, r in self.source._ranks.items()),
                                    self.source._stragglers(now), window_seconds=self.source.config.window_seconds)
        return [f for f in self.evaluator.evaluate({"timeline": snapshot}, now).findings if f.finding == "straggler"]

    def run(self, seconds: float) -> list[list[Finding]]:
        return [self.tick() for _ in range(round(seconds / TICK))]


def named_after(ticks: list[list[Finding]], rank: str) -> float | None:
    """Seconds until the rank was first named, or None."""
    return next(((i + 1) * TICK for i, found in enumerate(ticks) if [f.rank for f in found] == [rank]), None)


def straggling(job: Job, seconds: float = 120.0) -> tuple[list[list[Finding]], Pipeline]:
    """A healthy minute (no finding), then the slow rank's slowdown for ``seconds``."""
    pipeline = Pipeline(job)
    slow, extra = job.slow, job.extra
    job.slow, job.extra = None, 0.0
    healthy = pipeline.run(60.0)
    assert not any(healthy), healthy[-1]
    job.slow, job.extra = slow, extra
    return pipeline.run(seconds), pipeline


def test_a_plain_ddp_rank_slower_by_half_is_named_within_a_minute_and_held() -> None:
    job = Job(slow="1", extra=0.014, where="compute")  # its forward and backward: 28 ms + 14 ms
    ticks, _ = straggling(job)
    after = named_after(ticks, "1")
    assert after is not None and after <= 60.0, after
    assert all([f.rank for f in found] == ["1"] for found in ticks[int(after / TICK):])
    f = ticks[-1][0]
    assert f.evidence["step_last_share"] > 0.95 and f.evidence["last_share"] > 0.9, f.evidence


def test_a_trainer_like_straggler_is_named_though_each_bucket_is_a_coin_toss() -> None:
    """HF ``Trainer``: a gather at the start of each step re-aligns the ranks, and the slow
    rank (host work 1.5x the step's compute... here 20 ms more a step before the gather) is
    last there by its whole lag; at the ten buckets after it, either rank is last. Counted
    per collective it is last at about 55% of them, under the 60% line (the issue measured
    0.62-0.64 and a named-then-cleared finding); its lag over each step is the most at every
    step, and names it within the minute, held as long as it lasts."""
    job = Job(sync=True, slow="1", extra=0.02, where="host", seed=3)
    ticks, pipeline = straggling(job)
    after = named_after(ticks, "1")
    assert after is not None and after <= 60.0, after
    assert all([f.rank for f in found] == ["1"] for found in ticks[int(after / TICK):])
    f = ticks[-1][0]
    assert f.evidence["last_share"] < FindingsConfig().arrival_last_share < f.evidence["step_last_share"], f.evidence
    assert f.evidence["lag_share"] == pytest.approx(0.02 / f.evidence["step_seconds"], abs=0.03)
    assert f.evidence["step_max_lag_seconds"] == pytest.approx(0.02, abs=0.001)  # at the gather
    # its host work, before the gather, is its forward-and-host stage; the other waits in the
    # gather, in the same stage: no stage explains it
    assert f.evidence["cause"] is None and "No stage explains it" in f.summary, f.summary
    # over the window: every step of it is kept, 11 collectives each (the old 4,096-call buffer held 372)
    [s] = pipeline.source._stragglers(pipeline.clock())
    assert s.steps * 11 == s.collectives > 4096 and s.span_seconds > 59.0


def test_a_straggler_stays_named_while_it_lasts_and_goes_once_it_is_over() -> None:
    """Four minutes of a Trainer-like straggler, evaluated every half second: named without a
    gap, then gone within the window and the hold after the slowdown ends."""
    job = Job(sync=True, slow="0", extra=0.012, where="data", seed=5)
    ticks, pipeline = straggling(job, seconds=240.0)
    after = named_after(ticks, "0")
    assert after is not None and after <= 60.0, after
    held = ticks[int(after / TICK):]
    assert len(held) > 360 and all([f.rank for f in found] == ["0"] for found in held)
    job.slow, job.extra = None, 0.0
    over = pipeline.run(150.0)
    gone = next(i for i, found in enumerate(over) if not found) * TICK
    cfg = FindingsConfig()
    # the window must forget it (its steps' median), then the hold runs out
    assert gone <= 60.0 + cfg.hold_seconds + STRAGGLER_EVERY, gone
    assert not any(over[int(gone / TICK):])


def test_a_plain_ddp_rank_with_a_slow_dataloader_is_named_with_its_cause() -> None:
    """Rank 0 waits 8 ms more a step for its DataLoader (the issue's job: its data wait about
    25% of its step against 12%); rank 1 waits for it in backward. Named, and why."""
    job = Job(slow="0", extra=0.008, where="data", data=0.005, seed=9)
    ticks, _ = straggling(job, seconds=60.0)
    f = ticks[-1][0]
    assert f.rank == "0" and f.evidence["cause"] == "data_wait", f.summary
    mine, others = f.evidence["stage_shares"]["data_wait"], f.evidence["others_stage_shares"]["data_wait"]
    assert mine == pytest.approx(0.013 / f.evidence["step_seconds"], abs=0.02)
    assert others == pytest.approx(0.005 / f.evidence["step_seconds"], abs=0.02)
    assert f"Its data wait is {mine:.0%} of its step against {others:.0%} on the others: its DataLoader" in f.summary
    assert "DataLoader workers" in f.advice


@pytest.mark.parametrize(("ranks", "sync", "jitter", "seed"), [(2, False, 0.0005, 11), (2, True, 0.004, 15), (6, True, 0.003, 13)])
def test_a_healthy_noisy_job_names_no_one(ranks: int, sync: bool, jitter: float, seed: int) -> None:
    """Ranks of equal work on a loaded node: each takes its turn arriving last, by up to
    ``jitter`` per stage. Two minutes, no straggler at any evaluation."""
    pipeline = Pipeline(Job(ranks=ranks, sync=sync, jitter=jitter, seed=seed))
    ticks = pipeline.run(120.0)
    assert not any(ticks), next(found for found in ticks if found)[0].summary
    [s] = pipeline.source._stragglers(pipeline.clock())
    assert s.step_last_share < 0.6


def test_the_window_is_kept_in_steps_whatever_the_collectives_a_step() -> None:
    """FSDP-like: 200 collectives a step. The window's 60 s are all kept (a step each), and
    no more than STEPS_KEPT steps however fast the job."""
    job = Job(buckets=200, slow="1", extra=0.01, seed=7)
    pipeline = Pipeline(job)
    pipeline.run(70.0)
    kept = pipeline.source._arrivals["job"].steps
    assert kept[0].start >= pipeline.clock() - 60.0 and kept[-1].start > pipeline.clock() - 1.0
    assert sum(s.collectives for s in kept) == 200 * len(kept) > 100_000
    assert pipeline.source._arrivals["job"].cap == STEPS_KEPT


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

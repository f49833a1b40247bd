"""The step timeline's pure parts: folding probe events into steps and stages, matching
collectives across ranks, and the findings drawn from them (clock injected: events carry
their own times, analyzers take ``now``)."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest

from profagent.analysis import timeline as tl
from profagent.analysis.findings import steps as findings
from profagent.analysis.findings.inputs import AnalysisInputs
from profagent.analysis.straggler import stage_cause
from profagent.config import FindingsConfig
from profagent.contracts import (
    ArrivalStraggler,
    Finding,
    Frame,
    RankStall,
    RankSteps,
    TimelineSnapshot,
)
from profagent.sources.timeline.probes import PROBES, probe_offset

MAIN = 100


def loop(steps: int, accum: int = 1, data: float = 0.002, fwd: float = 0.003, bwd: float = 0.004,
         opt: float = 0.001, collectives: int = 2, start: float = 10.0, jitter: float = 0.0, seed: int = 0):
    """Events of a training loop as the probes see them, and its own truth: (events, calls,
    per-interval stage seconds)."""
    rng = random.Random(seed)
    t = start
    events: list[tuple[str, int, float]] = []
    calls: list[float] = []
    stages: list[dict[str, float]] = []

    def j(x: float) -> float:
        return x * (1 + rng.uniform(-jitter, jitter))

    for _ in range(steps):
        s = {"data_wait": 0.0, "backward": 0.0, "optimizer": 0.0}
        for _ in range(accum):
            d = j(data)
            events += [(tl.DATA, MAIN, t), (tl.RECORD_EXIT, MAIN, t + d)]
            t += d + j(fwd)
            b = j(bwd)
            events.append((tl.BACKWARD, MAIN, t))
            for k in range(collectives):
                events.append((tl.COLLECTIVE, MAIN, t + b * (k + 1) / (collectives + 1)))
            events.append((tl.BACKWARD_END, MAIN, t + b))
            t += b
            s["data_wait"] += d
            s["backward"] += b
        o = j(opt)
        calls.append(t)
        events += [(tl.STEP, MAIN, t), (tl.RECORD_EXIT, MAIN, t + o)]
        z = o / 4
        events += [(tl.ZERO_GRAD, MAIN, t + o), (tl.RECORD_EXIT, MAIN, t + o + z)]
        s["optimizer"] = o + z
        t += o + z
        stages.append(s)
    return events, calls, stages


def fold(events) -> tl.RankTimeline:
    r = tl.RankTimeline()
    for kind, tid, t in events:
        r.feed(kind, tid, t)
    return r


def test_steps_and_stages_match_the_loops_own_times() -> None:
    events, calls, stages = loop(50, jitter=0.3)
    r = fold(events)
    intervals = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert r.optimizer_steps == 50
    assert r.steps_total == len(intervals) == 49
    assert r.step_seconds_sum == pytest.approx(sum(intervals))
    # interval k holds optimizer k and the data wait and backward of step k+1
    assert r.stage_seconds["data_wait"] == pytest.approx(sum(s["data_wait"] for s in stages[1:]))
    assert r.stage_seconds["backward"] == pytest.approx(sum(s["backward"] for s in stages[1:]))
    assert r.stage_seconds["optimizer"] == pytest.approx(sum(s["optimizer"] for s in stages[:-1]))
    rest = sum(intervals) - sum(r.stage_seconds[s] for s in ("data_wait", "backward", "optimizer"))
    assert r.stage_seconds["other"] == pytest.approx(rest)
    assert sum(r.step_buckets) == 49
    assert [s.seconds for s in r.recent] == pytest.approx(intervals)


def test_gradient_accumulation_counts_backwards_per_step() -> None:
    events, _, _ = loop(10, accum=4)
    r = fold(events)
    assert r.backwards_total == 40
    assert [s.backwards for s in r.recent] == [4] * 9


def test_an_exit_without_its_entry_and_a_backward_that_raised_are_dropped() -> None:
    r = tl.RankTimeline()
    r.feed(tl.RECORD_EXIT, MAIN, 1.0)  # its entry came before the probes
    r.feed(tl.STEP, MAIN, 2.0)
    r.feed(tl.RECORD_EXIT, MAIN, 2.1)
    r.feed(tl.BACKWARD, MAIN, 2.5)  # raised: no end
    r.feed(tl.STEP, MAIN, 3.0)  # drops the open backward
    r.feed(tl.RECORD_EXIT, MAIN, 3.2)
    r.feed(tl.BACKWARD, MAIN, 3.5)
    r.feed(tl.BACKWARD_END, MAIN, 3.75)
    r.feed(tl.STEP, MAIN, 4.0)
    assert r.steps_total == 2
    assert r.stage_seconds["backward"] == pytest.approx(0.25)
    assert r.stage_seconds["optimizer"] == pytest.approx(0.1 + 0.2)
    assert all(block[tl.KIND] != tl.BACKWARD for block in r._open.get(MAIN, []))


def test_the_stage_now_is_the_newest_open_stage_of_any_thread() -> None:
    r = tl.RankTimeline()
    assert r.stage_now == ""
    r.feed(tl.DATA, MAIN, 1.0)
    assert r.stage_now == "data_wait"
    r.feed(tl.RECORD, MAIN, 1.1)  # a block of no stage inside it: still waiting for data
    assert r.stage_now == "data_wait"
    r.feed(tl.RECORD_EXIT, MAIN, 1.2)
    r.feed(tl.RECORD_EXIT, MAIN, 1.3)
    assert r.stage_now == ""
    r.feed(tl.BACKWARD, MAIN, 2.0)
    r.feed(tl.DATA, MAIN + 1, 2.1)  # a thread of its own prefetching data, newer
    assert r.stage_now == "data_wait"
    r.feed(tl.RECORD_EXIT, MAIN + 1, 2.2)
    assert r.stage_now == "backward"
    r.feed(tl.BACKWARD_END, MAIN, 2.5)
    r.feed(tl.STEP, MAIN, 2.6)
    assert r.stage_now == "optimizer"


def test_open_blocks_per_thread_are_bounded() -> None:
    r = tl.RankTimeline()
    for i in range(10 * tl.MAX_OPEN):
        r.feed(tl.RECORD, 7, float(i))
    assert len(r._open[7]) == tl.MAX_OPEN


def test_record_kinds_from_the_first_16_bytes_of_torchs_names() -> None:
    assert tl.record_kind(b"Optimizer.step#A") == tl.STEP
    assert tl.record_kind(b"Optimizer.zero_g") == tl.ZERO_GRAD
    assert tl.record_kind(b"enumerate(DataLo") == tl.DATA
    assert tl.record_kind(b"DistributedDataP") == tl.RECORD
    assert tl.record_kind(b"\x00" * 16) == tl.RECORD


def two_ranks(slow: str, lag: float, steps: int = 40, seed: int = 1) -> dict[str, list[tl.Step]]:
    """Two ranks whose k-th collective of each step the slow rank calls ``lag`` late."""
    rng = random.Random(seed)
    out: dict[str, list[tl.Step]] = {"0": [], "1": []}
    t = 100.0
    for _ in range(steps):
        base = [t + 0.002 * (k + 1) + rng.uniform(0, 1e-5) for k in range(5)]
        for rank in out:
            arrivals = tuple(b + (lag if rank == slow else rng.uniform(0, 2e-5)) for b in base)
            out[rank].append(tl.Step(t + rng.uniform(0, 1e-4), 0.02, {}, 1, arrivals))
        t += 0.02
    return out


def test_collectives_are_matched_by_step_and_order_and_the_late_rank_is_last() -> None:
    ranks = two_ranks("1", 0.004)
    arrivals, until = tl.match_arrivals(ranks, float("-inf"))
    assert len(arrivals) == 40 * 5
    assert until == ranks["0"][-1].start
    for a in arrivals:
        assert a.lags()["1"] == pytest.approx(0.004, abs=3e-5)
        assert a.lags()["0"] == 0.0
    summary = tl.last_arrivals(arrivals, 0.02)
    assert summary.last_counts == {"1": 200}
    assert summary.median_lag["1"] == pytest.approx(0.004, abs=3e-5)
    assert summary.step_lag["1"] == pytest.approx(5 * 0.004, abs=1.5e-4)  # five collectives a step, each late
    # already matched: nothing the second time
    assert tl.match_arrivals(ranks, until) == ([], until)


def test_a_steps_lags_add_up_but_calls_back_to_back_count_once() -> None:
    """FSDP: a collective per layer, each late by a slice of the step. Two calls with no
    work between (one call hitting two probed functions) are one wait, not two."""
    arrivals = []
    for step in range(10):
        start = 100.0 + step
        late = [0.003, 0.003, 0.005, 0.002, 0.002]  # the second and fifth follow the one before at once
        for k, lag in enumerate(late):
            t = start + 0.01 * k - (0.01 - 5e-5 if k in (1, 4) else 0.0)
            arrivals.append(tl.Arrival(start, k, {"0": t, "1": t + lag, "2": t + 1e-5}))
    summary = tl.last_arrivals(arrivals, 0.05)
    assert summary.step_lag["1"] == pytest.approx(0.003 + 0.005 + 0.002)
    assert summary.step_lag["2"] == pytest.approx(3 * 1e-5)
    assert summary.median_lag["1"] == pytest.approx(0.003)


def test_a_step_one_rank_has_not_finished_is_left_for_later() -> None:
    ranks = two_ranks("1", 0.001, steps=10)
    ranks["1"] = ranks["1"][:7]
    arrivals, until = tl.match_arrivals(ranks, float("-inf"))
    assert len(arrivals) == 7 * 5
    assert until == ranks["0"][6].start


def test_ranks_arriving_together_name_no_one() -> None:
    summary = tl.last_arrivals(tl.match_arrivals(two_ranks("none", 0.0), float("-inf"))[0], 0.02)
    assert summary.last_counts == {}


def test_quantile_is_numpys_linear_interpolation() -> None:
    values = [random.Random(3).uniform(0, 1) for _ in range(101)]
    ordered = sorted(values)
    assert tl.quantile(values, 0.5) == ordered[50]
    assert tl.quantile([1.0, 2.0, 3.0, 4.0], 0.9) == pytest.approx(3.7)


def steps_of(rank: str, **kw) -> RankSteps:
    base = dict(job_id="j", rank=rank, pid=int(rank) + 10, optimizer_steps=100, steps_total=99, step_seconds_sum=2.0,
                step_buckets=(0,) * 15, stage_seconds={}, backwards_total=100, collectives_total=500,
                window_steps=50, p50=0.02, p90=0.025, max=0.03, steps_per_second=50.0, micro_batches=1.0,
                stage_shares={"data_wait": 0.1, "backward": 0.4, "optimizer": 0.1, "other": 0.4}, stage_now="",
                idle_seconds=0.01, since_step_seconds=0.01, lag_buckets=(0,) * 15, lag_seconds_sum=0.0, lag_count=0)
    base.update(kw)
    return RankSteps(**base)


def inputs(timeline: TimelineSnapshot, **kw) -> AnalysisInputs:
    return AnalysisInputs(config=FindingsConfig(), now=1000.0, timeline=timeline, **kw)


def test_arrival_straggler_needs_a_persistent_last_place_and_a_real_lag() -> None:
    cfg = FindingsConfig()
    ranks = (steps_of("0"), steps_of("1"))

    def verdict(last_share: float, lag: float, collectives: int = 200, span: float = 60.0,
                others: float = 0.001) -> list[str | None]:
        s = ArrivalStraggler("j", "1", 0.5, lag / 4, lag + others, others, 0.02, collectives, span, last_share, 40)
        return [f.rank for f in findings.analyze_arrival_straggler(inputs(TimelineSnapshot(ranks, (s,))))]

    assert verdict(0.9, 0.004) == ["1"]
    assert verdict(cfg.arrival_last_share - 0.01, 0.004) == []  # not persistently the most late over a step
    assert verdict(0.9, cfg.arrival_lag_share * 0.02 * 0.9) == []  # last by a hair, a step's lags added up
    assert verdict(0.65, 0.004, others=0.0) == ["1"]
    # last a little more often than the others, who wait about as long for it as it for them
    assert verdict(0.65, cfg.arrival_lag_share * 0.02 * 0.9, others=0.03) == []
    assert verdict(0.9, 0.004, collectives=cfg.arrival_min_collectives - 1) == []  # too few to say
    assert verdict(0.9, 0.004, span=cfg.arrival_min_seconds - 1) == []  # too short a time to say
    s = ArrivalStraggler("j", "1", 0.9, 0.001, 0.004, 0.0, 0.02, 200, 60.0, 0.9, 40)
    assert findings.analyze_arrival_straggler(inputs(TimelineSnapshot(ranks, (s,)), hung=frozenset({"j"}))) == []
    quiet = (steps_of("0", idle_seconds=40.0), steps_of("1", idle_seconds=40.0))
    assert findings.analyze_arrival_straggler(inputs(TimelineSnapshot(quiet, (s,)))) == []  # steps stopped


def shares(data: float, backward: float, optimizer: float) -> dict[str, float]:
    return {"data_wait": data, "backward": backward, "optimizer": optimizer, "other": 1 - data - backward - optimizer}


def times_to_shares(times: dict[str, float]) -> dict[str, float]:
    total = sum(times.values())
    return {stage: t / total for stage, t in times.items()}


def test_the_stage_that_explains_a_stragglers_lag() -> None:
    """The issue's job: rank 0's data wait 25% of its step against 12% on rank 1, which
    waits for it in backward (DDP's reducer), with equal compute."""
    cause = stage_cause({"0": shares(0.25, 0.35, 0.05), "1": shares(0.12, 0.48, 0.05)}, "0")
    assert cause is not None and cause.stage == "data_wait"
    assert (cause.shares["data_wait"], cause.others["data_wait"]) == (0.25, 0.12)
    # four ranks: the others' median; one of them with a slow loader too does not hide it
    four = {"0": shares(0.25, 0.35, 0.05), "1": shares(0.12, 0.48, 0.05), "2": shares(0.1, 0.5, 0.05),
            "3": shares(0.2, 0.4, 0.05)}
    assert stage_cause(four, "0").stage == "data_wait"  # type: ignore[union-attr]
    # a forward twice as long (its step 36 ms: data 4, forward 24, backward 4+4, optimizer 4;
    # the other's forward 12 and backward 16 of which 12 waiting)
    slow = times_to_shares({"data_wait": 4, "other": 24, "backward": 4, "optimizer": 4})
    other = times_to_shares({"data_wait": 4, "other": 12, "backward": 16, "optimizer": 4})
    assert stage_cause({"0": other, "1": slow}, "1").stage == "other"  # type: ignore[union-attr]
    # an optimizer step three times as long (more state on that rank)
    slow = times_to_shares({"data_wait": 4, "other": 12, "backward": 8, "optimizer": 12})
    other = times_to_shares({"data_wait": 4, "other": 12, "backward": 16, "optimizer": 4})
    assert stage_cause({"0": other, "1": slow}, "1").stage == "optimizer"  # type: ignore[union-attr]


def test_no_stage_explains_a_rank_slower_all_through() -> None:
    """A slower device or a busy node: every stage of rank 1 takes 1.5 times as long (data
    4 -> 6 ms, forward 12 -> 18, backward 16 -> 24, optimizer 3 -> 4.5); rank 0 waits the
    difference in its backward. Rank 1 spends more in three stages, by the same proportion."""
    slow = times_to_shares({"data_wait": 6, "other": 18, "backward": 24, "optimizer": 4.5})
    fast = times_to_shares({"data_wait": 4, "other": 12, "backward": 52.5 - 19, "optimizer": 3})
    cause = stage_cause({"0": fast, "1": slow}, "1")
    assert cause is not None and cause.stage == "", cause
    # HF Trainer-like: host work before the step's gather; the others wait in that gather,
    # in the same stage ("other"): no stage stands above the others'
    slow = times_to_shares({"data_wait": 4, "other": 12 + 2 + 20, "backward": 16, "optimizer": 3})
    fast = times_to_shares({"data_wait": 4, "other": 12 + 2 + 20, "backward": 16, "optimizer": 3})
    assert stage_cause({"0": fast, "1": slow}, "1").stage == ""  # type: ignore[union-attr]
    assert stage_cause({"1": slow}, "1") is None and stage_cause({"0": fast, "1": {}}, "1") is None


def test_the_straggler_finding_names_its_cause_and_the_advice_for_it() -> None:
    s = ArrivalStraggler("j", "0", 0.95, 0.006, 0.012, 0.0005, 0.05, 2000, 60.0, 0.97, 1200, 0.0062)

    def found(*stage_shares: dict[str, float]) -> Finding:
        ranks = tuple(steps_of(str(r), stage_shares=x) for r, x in enumerate(stage_shares))
        [f] = findings.analyze_arrival_straggler(inputs(TimelineSnapshot(ranks, (s,))))
        return f

    f = found(shares(0.25, 0.35, 0.05), shares(0.12, 0.48, 0.05))
    assert f.rank == "0" and f.summary.startswith(
        "rank 0 is the straggler: it lagged the most at 97% of the job's last 1200 steps, up to 6.2 ms behind the first "
        "rank at the median step; its lags of a step add up to 12.0 ms against 0.5 ms for the others (23% of a 50 ms "
        "step more; 2000 collectives, last at 95% of them); the others wait for it. "), f.summary
    assert f.summary.endswith("Its data wait is 25% of its step against 12% on the others: its DataLoader"), f.summary
    assert "DataLoader workers" in f.advice and f.evidence["cause"] == "data_wait"
    assert f.evidence["stage_shares"]["data_wait"] == 0.25 and f.evidence["others_stage_shares"]["data_wait"] == 0.12
    slow = times_to_shares({"data_wait": 6, "other": 18, "backward": 24, "optimizer": 4.5})
    fast = times_to_shares({"data_wait": 4, "other": 12, "backward": 52.5 - 19, "optimizer": 3})
    f = found(slow, fast)
    assert "No stage explains it (data wait 11% against 8%, backward 46% against 64%" in f.summary, f.summary
    assert f.summary.endswith("on the others): more work, a slower device or a busy node") and "busy node" in f.advice
    assert f.evidence["cause"] is None
    # no stages measured for the others (a rank with no step in the window): the lag alone
    ranks = (steps_of("0", stage_shares=slow), steps_of("1", window_steps=0, stage_shares={}))
    [f] = findings.analyze_arrival_straggler(inputs(TimelineSnapshot(ranks, (s,))))
    assert f.summary.endswith("the others wait for it") and "cause" not in f.evidence and f.advice == findings.STRAGGLER_ADVICE


def test_probed_jobs_take_their_straggler_from_arrivals_only() -> None:
    s = ArrivalStraggler("j", "1", 0.5, 0.0001, 0.0005, 0.0, 0.02, 200)
    assert findings.probed_jobs(inputs(TimelineSnapshot((steps_of("0"),), (s,)))) == {"j"}
    few = ArrivalStraggler("j", "1", 0.5, 0.0001, 0.0005, 0.0, 0.02, 10)
    assert findings.probed_jobs(inputs(TimelineSnapshot((steps_of("0"),), (few,)))) == frozenset()


def test_data_wait_share_above_the_bound_ratio() -> None:
    cfg = FindingsConfig()
    slow = steps_of("1", stage_shares={"data_wait": cfg.bound_ratio + 0.05})
    fine = steps_of("0", stage_shares={"data_wait": cfg.bound_ratio - 0.05})
    few = steps_of("2", stage_shares={"data_wait": 0.9}, window_steps=cfg.min_steps - 1)
    got = findings.analyze_data_wait(inputs(TimelineSnapshot((fine, slow, few))))
    assert [(f.finding, f.rank, f.evidence["signal"]) for f in got] == [("dataloader_bound", "1", "timeline")]


def test_stall_names_the_rank_that_called_fewest_collectives_with_its_own_line() -> None:
    cfg = FindingsConfig()
    quiet = cfg.stall_warning_seconds + 1
    # rank 0 was first seen later (fewer in total) but called its next collective: rank 1 holds
    ranks = (steps_of("0", idle_seconds=quiet, since_step_seconds=quiet + 0.02, stage_now="backward",
                      step_collectives=1, collectives_total=400),
             steps_of("1", idle_seconds=quiet, since_step_seconds=quiet + 0.02, step_collectives=0,
                      collectives_total=497))
    frames = (Frame("<module>", "train.py", 200), Frame("main", "train.py", 104), Frame("sleep", "", 0),
              Frame("forward", "torch/nn/modules/module.py", 1))
    stalls = (RankStall("1", False, 31.0, "j", frames),)
    (f,) = findings.analyze_stall(inputs(TimelineSnapshot(ranks), stalls=stalls))
    assert (f.finding, f.rank, f.severity) == ("stall", "1", "warning")
    assert "rank 1 (in the forward or host code at" in f.summary and "(train.py:104)" in f.summary
    assert f.evidence["holding_ranks"] == ["1"]
    # a stack from a window that began before the rank stopped says where it was, not where it stands
    before = (dataclasses.replace(stalls[0], window_age_seconds=quiet + 5),)
    (f,) = findings.analyze_stall(inputs(TimelineSnapshot(ranks), stalls=before))
    assert f.rank == "1" and "train.py" not in f.summary and f.evidence["locations"] == {}


def test_a_job_whose_probes_went_quiet_is_pausing_before_any_stall() -> None:
    quiet = (steps_of("0", idle_seconds=3.5, p90=0.05), steps_of("1", idle_seconds=3.5, p90=0.05))
    assert findings.pausing_jobs(TimelineSnapshot(quiet)) == {"j"}
    one_steps = (steps_of("0", idle_seconds=3.5, p90=0.05), steps_of("1", idle_seconds=0.1, p90=0.05))
    slow = (steps_of("0", idle_seconds=3.5, p90=2.0),)  # 3 x its p90 step not reached
    assert findings.pausing_jobs(TimelineSnapshot(one_steps)) == findings.pausing_jobs(TimelineSnapshot(slow)) \
        == findings.pausing_jobs(None) == frozenset()


def test_a_rank_the_probes_saw_step_is_busy_for_the_stall_verdict() -> None:
    """A rank that waits for a straggler in every step can show that one wait in every py-spy
    sample of a window; its steps say it works, so its stack alone never stalls it."""
    from types import SimpleNamespace

    from profagent.engine.agent import Job
    from profagent.state import State

    t = TimelineSnapshot((steps_of("0", since_step_seconds=0.2), steps_of("1", since_step_seconds=12.0),
                          steps_of("2", since_step_seconds=None)))
    assert findings.stepped_within(t, "j", "0", 10.0) and findings.stepped_within(t, "", "0", 10.0)
    assert not findings.stepped_within(t, "j", "1", 10.0)  # no step for longer than that
    assert not findings.stepped_within(t, "j", "2", 10.0)  # never stepped (an evaluation, start-up)
    assert not findings.stepped_within(t, "other", "0", 10.0) and not findings.stepped_within(None, "j", "0", 10.0)
    state = State()
    job = SimpleNamespace(state=state, stall_seconds=10.0)
    assert Job.rank_busy(job, "0", "j") is None  # nothing known yet
    state.publish("timeline", t, 0.0)
    assert Job.rank_busy(job, "0", "j") is True
    assert Job.rank_busy(job, "1", "j") is None  # no GPU signal either: the stacks decide


def test_no_stall_before_the_threshold_nor_in_an_evaluation_loop() -> None:
    cfg = FindingsConfig()
    slow_steps = (steps_of("0", idle_seconds=31.0, p90=5.0), steps_of("1", idle_seconds=31.0, p90=5.0))
    assert findings.analyze_stall(inputs(TimelineSnapshot(slow_steps))) == []  # 10 x p90 = 50 s not reached
    evaluating = (steps_of("0", idle_seconds=0.5, since_step_seconds=300.0),)
    assert findings.analyze_stall(inputs(TimelineSnapshot(evaluating))) == []
    together = (steps_of("0", idle_seconds=cfg.stall_warning_seconds + 1),
                steps_of("1", idle_seconds=cfg.stall_warning_seconds + 1))
    (f,) = findings.analyze_stall(inputs(TimelineSnapshot(together)))
    assert f.rank is None and "every rank seen here waits" in f.summary


def test_every_probe_pattern_names_one_kind_of_torch_function() -> None:
    keys = [p.key for p in PROBES]
    assert len(keys) == len(set(keys))
    for p in PROBES:
        assert re.fullmatch(rb"[A-Za-z0-9_]+", p.key.encode())
        assert p.pattern.pattern.startswith(b"_ZN")


@pytest.mark.parametrize(("code", "kind", "offset"), [
    (b"\x55\x48\x89\xe5", tl.BACKWARD, 0),  # push %rbp
    (b"\x41\x55\x49\x89", tl.RECORD, 0),  # push %r13
    (b"\xf3\x0f\x1e\xfa\x41\x57", tl.BACKWARD, 4),  # endbr64; push %r15
    (b"\xe9\x0b\xdd\xff\xff", tl.COLLECTIVE, 0),  # jmp: a tail call
    (b"\x48\x8b\x3f\x48\x83\xc7\x10\xe9\x00\x00\x00\x00", tl.RECORD_EXIT, 7),  # the jmp to RecordFunction::end
    (b"\x80\x7f\x68\x00\x74\x5a", tl.BACKWARD, None),  # cmpb: single-stepped, refused
    (b"\x48\x8b\x3f\x48\x83\xc7\x10\xe9", tl.BACKWARD, None),  # that pattern only for the exit
    (b"", tl.BACKWARD, None),
])
def test_probes_go_only_on_instructions_the_kernel_emulates(code: bytes, kind: str, offset: int | None) -> None:
    assert probe_offset(code, kind) == offset


def test_a_probed_step_time_above_the_factor_for_long_enough_is_a_regression(tmp_path) -> None:
    """The incident trigger on the probes' p50 (no trace): three values make the baseline,
    then a p50 above regression_factor x that baseline for regression_seconds triggers."""
    from profagent.config import IncidentsConfig
    from profagent.contracts import ProcessInfo, ProcessTree, StateView
    from profagent.engine.incidents.trigger import PROBED_EVERY, IncidentsSource
    from profagent.state import State

    cfg = IncidentsConfig(regression_factor=2.0, regression_seconds=60.0)
    source = IncidentsSource(cfg, tmp_path, State())
    tree = ProcessTree("j", 1, (ProcessInfo(10, 1, 0.0, "main", "0", "0", "1", "train.py", "j"),), True)

    window = 60.0
    every = PROBED_EVERY * window  # one value every half window

    def tick(now: float, p50: float) -> list:
        view = StateView(tree=tree, timeline=TimelineSnapshot((steps_of("0", p50=p50),), window_seconds=window))
        return source._probed_regressions(view, tree, now)

    now = 1000.0
    for _ in range(3):  # the baseline: 20 ms
        assert tick(now, 0.020) == []
        assert tick(now + every / 2, 0.100) == []  # between two values: not looked at
        now += every
    assert tick(now, 0.039) == []  # below 2x
    now += every
    began = now
    assert tick(now, 0.050) == []  # above, not yet for 60 s
    while now - began < cfg.regression_seconds:
        now += every
        triggers = tick(now, 0.050)
    (t,) = triggers
    assert (t.kind, t.job_id, t.rank) == ("regression", "j", "0")
    assert t.evidence["baseline_seconds"] == pytest.approx(0.020)
    assert t.evidence["step_seconds"] == pytest.approx(0.050)
    assert t.evidence["measured_by"] == "kernel probes, no trace"


def closure_loop(steps: int, closures: int = 1, seed: int = 1):
    """Events of ``optimizer.step(closure)`` (Lightning, LBFGS): the closure's forward,
    zero_grad and backward run inside Optimizer.step's block. Returns the events, the step
    calls and the truth per interval between calls, by what ran: the closure's forward and
    the time between closures are other, what follows the last backward and zero_grad are
    the optimizer."""
    rng = random.Random(seed)
    t, events, calls, truth = 5.0, [], [], []
    for _ in range(steps):
        s = dict.fromkeys(tl.STAGES, 0.0)
        calls.append(t)
        events.append((tl.STEP, MAIN, t))
        for c in range(closures):
            if c:
                between = rng.uniform(0.001, 0.002)  # the line search's arithmetic
                t += between
                s["other"] += between
            fwd, zero, bwd = rng.uniform(0.002, 0.004), rng.uniform(0.0002, 0.0004), rng.uniform(0.004, 0.008)
            t += fwd
            s["other"] += fwd
            events += [(tl.ZERO_GRAD, MAIN, t), (tl.RECORD_EXIT, MAIN, t + zero)]
            t += zero
            s["optimizer"] += zero
            events += [(tl.RECORD, MAIN, t), (tl.BACKWARD, MAIN, t + 0.0001), (tl.COLLECTIVE, MAIN, t + bwd / 2),
                       (tl.BACKWARD_END, MAIN, t + bwd), (tl.RECORD_EXIT, MAIN, t + bwd + 0.0001)]
            # the record block around backward(): outside Engine::execute, other before it and,
            # as what remains of the step's block after its last backward, optimizer after
            s["other"] += 0.0001
            s["optimizer" if c == closures - 1 else "other"] += 0.0001
            s["backward"] += bwd - 0.0001
            t += bwd + 0.0001
        update = rng.uniform(0.001, 0.003)
        events.append((tl.RECORD_EXIT, MAIN, t + update))
        t += update
        s["optimizer"] += update
        host, data = rng.uniform(0.0005, 0.001), rng.uniform(0.001, 0.003)
        events += [(tl.DATA, MAIN, t + host), (tl.RECORD_EXIT, MAIN, t + host + data)]
        s["other"] += host
        s["data_wait"] += data
        t += host + data
        truth.append(s)
    return events, calls, truth


@pytest.mark.parametrize("closures", [1, 3])
def test_a_closure_inside_optimizer_step_is_counted_once_by_its_own_stage(closures: int) -> None:
    events, calls, truth = closure_loop(40, closures)
    r = fold(events)
    assert r.step_boundary == tl.OPTIMIZER
    assert r.optimizer_steps == 40 and r.steps_total == 39
    intervals = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert [s.seconds for s in r.recent] == pytest.approx(intervals)
    for step, want in zip(r.recent, truth, strict=False):  # interval k holds step k's closure and update
        assert dict(step.stages) == pytest.approx(want, abs=1e-9)
        assert sum(step.stages.values()) == pytest.approx(step.seconds)
    assert r.backwards_total == 40 * closures


def test_shares_of_a_step_never_add_above_the_step() -> None:
    """A DataLoader's wait on a thread of its own while the main thread's backward runs:
    the step's stages are scaled to the step, never 100% and more."""
    r = tl.RankTimeline()
    for i in range(4):
        t = 1.0 + i
        r.feed(tl.STEP, MAIN, t)
        r.feed(tl.RECORD_EXIT, MAIN, t + 0.2)
        r.feed(tl.BACKWARD, MAIN, t + 0.3)
        r.feed(tl.DATA, MAIN + 1, t + 0.3)
        r.feed(tl.RECORD_EXIT, MAIN + 1, t + 0.9)
        r.feed(tl.BACKWARD_END, MAIN, t + 0.95)
    r.feed(tl.STEP, MAIN, 5.0)
    for step in r.recent:
        assert sum(step.stages.values()) == pytest.approx(step.seconds)
        assert step.stages["other"] == pytest.approx(0.0)


def test_a_reentrant_backward_inside_a_backward_is_counted_once() -> None:
    r = tl.RankTimeline()
    r.feed(tl.STEP, MAIN, 1.0)
    r.feed(tl.RECORD_EXIT, MAIN, 1.1)
    r.feed(tl.BACKWARD, MAIN, 1.2)
    r.feed(tl.BACKWARD, MAIN, 1.3)  # activation checkpointing's recomputation
    r.feed(tl.BACKWARD_END, MAIN, 1.5)
    r.feed(tl.BACKWARD_END, MAIN, 1.8)
    r.feed(tl.STEP, MAIN, 2.0)
    assert r.stage_seconds["backward"] == pytest.approx(0.6)
    assert r.stage_seconds["optimizer"] == pytest.approx(0.1)
    assert r.stage_seconds["other"] == pytest.approx(0.3)


def compiled(events, keep_zero_grad: bool):
    """The events as a compiled optimizer step leaves them: no Optimizer.step block (its
    record_function is dropped), nor zero_grad's when it is compiled too."""
    out, skip = [], 0
    for kind, tid, t in events:
        if kind == tl.STEP or (kind == tl.ZERO_GRAD and not keep_zero_grad):
            skip += 1  # its exit goes too
            continue
        if kind == tl.RECORD_EXIT and skip:
            skip -= 1
            continue
        out.append((kind, tid, t))
    return out


def test_without_optimizer_blocks_the_steps_come_from_zero_grad_calls() -> None:
    events, calls, _ = loop(60, accum=4, jitter=0.3, seed=3)
    r = fold(compiled(events, keep_zero_grad=True))
    assert r.step_boundary == tl.BY_ZERO_GRAD and r.optimizer_steps == 60  # the steps begun, at zero_grad
    assert r.steps_total == 59
    zero_grads = [t for kind, _, t in events if kind == tl.ZERO_GRAD]
    assert [s.seconds for s in r.recent] == pytest.approx([b - a for a, b in zip(zero_grads, zero_grads[1:], strict=False)])
    assert [s.backwards for s in r.recent] == [4] * 59
    assert "capture_profiler_record_function" in tl.boundary_note(r.step_boundary)


def test_without_optimizer_nor_zero_grad_blocks_the_steps_come_from_backwards() -> None:
    events, calls, stages = loop(60, jitter=0.3, seed=4)
    r = fold(compiled(events, keep_zero_grad=False))
    assert r.step_boundary == tl.BY_BACKWARD
    backwards = [t for kind, _, t in events if kind == tl.BACKWARD]
    intervals = [b - a for a, b in zip(backwards, backwards[1:], strict=False)]
    assert r.steps_total == 59 and [s.seconds for s in r.recent] == pytest.approx(intervals)
    assert tl.quantile([s.seconds for s in r.recent], 0.5) == pytest.approx(tl.quantile(intervals, 0.5))
    # interval k holds backward k and the data wait of step k+1; the update is other
    assert r.stage_seconds["backward"] == pytest.approx(sum(s["backward"] for s in stages[:-1]))
    assert r.stage_seconds["data_wait"] == pytest.approx(sum(s["data_wait"] for s in stages[1:]))
    assert r.stage_seconds["optimizer"] == 0.0


def test_ddp_accumulation_without_optimizer_blocks_steps_at_the_synchronising_backward() -> None:
    """DDP's no_sync micro-batches call no collective in their backward; the last one does."""
    events, _, _ = loop(50, accum=4, seed=5)
    backward_no, kept, syncs = 0, [], []
    for kind, tid, t in compiled(events, keep_zero_grad=False):
        if kind == tl.BACKWARD:
            backward_no += 1
            if backward_no % 4 == 1:
                syncs.append(t)  # the first micro-batch of a step
        if kind == tl.COLLECTIVE and backward_no % 4:
            continue  # under no_sync
        kept.append((kind, tid, t))
    r = fold(kept)
    assert r.step_boundary == tl.BY_BACKWARD and r.steps_total == 49
    assert [s.seconds for s in r.recent] == pytest.approx([b - a for a, b in zip(syncs, syncs[1:], strict=False)])
    assert [s.backwards for s in r.recent] == [4] * 49


def test_a_late_optimizer_block_becomes_the_boundary_and_none_is_said() -> None:
    r = tl.RankTimeline()
    for i in range(400):  # an evaluation loop: DataLoader waits only, for 40 s
        r.feed(tl.DATA, MAIN, i * 0.1)
        r.feed(tl.RECORD_EXIT, MAIN, i * 0.1 + 0.05)
    assert r.step_boundary == tl.NONE and "capture_profiler_record_function" in tl.boundary_note(tl.NONE)
    assert r.steps_total == 0
    events, _, _ = loop(10, start=50.0)
    for e in events:
        r.feed(*e)
    assert r.step_boundary == tl.OPTIMIZER and r.optimizer_steps == 10 and r.steps_total == 9
    assert tl.boundary_note(tl.OPTIMIZER) == ""


def test_open_blocks_of_a_rank_are_bounded_and_exited_threads_dropped() -> None:
    """A job churning threads that each open MAX_OPEN blocks and never close them."""
    r = tl.RankTimeline()
    events, calls, _ = loop(20, start=1.0)
    for n, (kind, tid, t) in enumerate(events):
        r.feed(kind, tid, t)
        for k in range(64):
            r.feed(tl.RECORD, 1000 + n, t + k * 1e-9)
    assert r._open_count <= tl.MAX_OPEN_RANK
    assert sum(len(s) for s in r._open.values()) == r._open_count
    assert r.optimizer_steps == 20 and r.steps_total == 19  # the boundaries hold regardless
    assert r.dropped_blocks > 0
    r.forget_threads([tid for tid in r.open_threads if tid != MAIN])
    assert r.open_threads in ([MAIN], []) and r._open_count == sum(len(s) for s in r._open.values())
    more, _, stages = loop(10, start=100.0)
    before = dict(r.stage_seconds)
    for e in more:
        r.feed(*e)
    # the step from the last old call to the first new one holds the first new backward
    assert r.stage_seconds["backward"] - before["backward"] == pytest.approx(sum(s["backward"] for s in stages))


def test_held_events_are_bounded_and_a_full_hold_decides() -> None:
    """Hundreds of record_function blocks a step and no Optimizer.step block: the hold is
    full before 32 backwards; the backwards seen decide, and no step is lost."""
    events, _, _ = loop(12, seed=6)
    noisy = []
    for kind, tid, t in compiled(events, keep_zero_grad=False):
        noisy.append((kind, tid, t))
        if kind == tl.BACKWARD_END:
            noisy += [(tl.RECORD, MAIN, t + 1e-7), (tl.RECORD_EXIT, MAIN, t + 2e-7)] * 400
    r = tl.RankTimeline()
    for e in noisy:
        r.feed(*e)
        assert r._held is None or len(r._held) <= tl.HELD_EVENTS
    assert r.step_boundary == tl.BY_BACKWARD and r.steps_total == 11
    quiet = tl.RankTimeline()
    for i in range(tl.HELD_EVENTS):
        quiet.feed(tl.RECORD, MAIN, i * 1e-3)
    assert quiet.boundary == tl.NONE and quiet.steps_total == 0


def _iteration(t: float, lightning: bool, collectives: int = 3) -> list[tuple[str, int, float]]:
    """One training iteration from ``t``, 50 ms: data 5, forward 15, backward 20 with its
    collectives, update 5, host 5. Lightning's optimizer.step(closure) opens the step's
    block before the forward; a plain loop calls Optimizer.step after its backward."""
    ev = [(tl.DATA, MAIN, t), (tl.RECORD_EXIT, MAIN, t + 0.005)]
    if lightning:
        ev.append((tl.STEP, MAIN, t + 0.005))
    ev.append((tl.BACKWARD, MAIN, t + 0.020))
    ev += [(tl.COLLECTIVE, MAIN, t + 0.020 + 0.020 * (k + 1) / (collectives + 1)) for k in range(collectives)]
    ev.append((tl.BACKWARD_END, MAIN, t + 0.040))
    if not lightning:
        ev.append((tl.STEP, MAIN, t + 0.040))
    return [*ev, (tl.RECORD_EXIT, MAIN, t + 0.045)]


def _rank_steps(rank: str, r: tl.RankTimeline, now: float) -> RankSteps:
    seconds = [s.seconds for s in r.recent]
    return steps_of(rank, optimizer_steps=r.optimizer_steps, steps_total=r.steps_total,
                    collectives_total=r.collectives_total, p50=tl.quantile(seconds, 0.5), p90=tl.quantile(seconds, 0.9),
                    stage_now=r.stage_now, idle_seconds=now - (r.last_event or 0.0),
                    since_step_seconds=now - (r.last_step or 0.0), step_collectives=len(r.arrivals_in_step))


@pytest.mark.parametrize("lightning", [True, False], ids=["step-before-forward", "step-after-backward"])
@pytest.mark.parametrize("stuck", ["0", "1"])
@pytest.mark.parametrize("where", ["host", "forward"])
def test_stall_names_the_rank_a_step_behind_on_every_loop_shape(lightning: bool, stuck: str, where: str) -> None:
    """Two ranks go through 40 iterations together; the stuck one stops in its host code after an
    iteration (a user callback) or in its next forward; the other goes on until its next
    iteration's first collective, where it waits. The rank named is the one that stopped,
    whatever each rank's count (the other was first seen 7 iterations later)."""
    period, start = 0.05, 10.0
    events: dict[str, list[tuple[str, int, float]]] = {"0": [], "1": []}
    for i in range(40):
        for rank in events:
            if rank != stuck and i < 7:
                continue  # first seen later: fewer steps and collectives counted in total
            events[rank] += _iteration(start + i * period, lightning)
    following = start + 40 * period
    nxt = _iteration(following, lightning)
    kinds = [kind for kind, _, _ in nxt]
    events[str(1 - int(stuck))] += nxt[:kinds.index(tl.COLLECTIVE) + 1]  # the other waits in that collective
    if where == "forward":  # the stuck rank entered the next iteration and stopped before its backward
        events[stuck] += nxt[:kinds.index(tl.BACKWARD)]
    now = following + FindingsConfig().stall_warning_seconds + 1
    ranks = tuple(_rank_steps(rank, fold(ev), now) for rank, ev in events.items())
    (f,) = findings.analyze_stall(inputs(TimelineSnapshot(ranks)))
    assert f.rank == stuck and f.evidence["holding_ranks"] == [stuck], (f.summary, f.evidence)
    assert f"rank {stuck} (" in f.summary and f"rank {1 - int(stuck)} (" not in f.summary, f.summary

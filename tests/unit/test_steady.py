"""Findings that hold steady (analysis/findings/steady.py), with an injected clock."""

from __future__ import annotations

from profagent.analysis.findings.evaluate import Evaluator
from profagent.analysis.findings.steady import Steady
from profagent.config import FindingsConfig
from profagent.contracts import Finding

STRAGGLER = Finding("straggler", "j", "1", "warning", "rank 1 is the straggler")
LIVE = {("j", "0"), ("j", "1")}


def test_a_flapping_finding_stays_until_its_evidence_is_gone_for_the_hold() -> None:
    steady = Steady(hold_seconds=30.0)
    # the straggler's share on its line: seen in one evaluation of three (the issue saw 21-49 %)
    seen = [i % 3 == 0 for i in range(30)]  # t = 0, 5, ... 145
    active = [bool(steady([STRAGGLER] if s else [], 5.0 * i, LIVE)) for i, s in enumerate(seen)]
    assert all(active), active  # no gap: an alert with `for:` fires
    # evidence gone: active until 30 s after the last sighting (t = 135), then not
    assert steady([], 160.0, LIVE) and not steady([], 165.0, LIVE)


def test_never_held_through_a_hang_nor_after_its_rank_ended() -> None:
    steady = Steady(hold_seconds=60.0)
    assert steady([STRAGGLER], 0.0, LIVE) == [STRAGGLER]
    assert steady([], 5.0, LIVE, quiet_jobs={"j"}) == []  # the job hangs: its straggler is the hang
    assert steady([], 10.0, LIVE) == []  # and it does not come back when the hang ends
    steady([STRAGGLER], 20.0, LIVE)
    assert steady([], 25.0, {("j", "0")}) == []  # rank 1 no longer measured
    job_wide = Finding("dataloader_bound", "j", None, "warning", "the job waits on data")
    steady([job_wide], 30.0, LIVE)
    assert steady([], 35.0, LIVE) == [job_wide]
    assert steady([], 40.0, {("k", "0")}) == []  # the job ended


def test_a_hang_or_leak_is_not_held_and_no_finding_is_doubled() -> None:
    steady = Steady(hold_seconds=60.0)
    hang = Finding("hang", "j", "1", "critical", "rank 1 holds the job up")
    steady([hang, STRAGGLER], 0.0, LIVE)
    assert steady([], 5.0, LIVE) == [STRAGGLER]
    assert steady([STRAGGLER], 10.0, LIVE) == [STRAGGLER]  # once, not held and found
    assert Steady(0.0)([], 0.0, LIVE) == []


def test_the_evaluator_holds_with_the_configured_hold() -> None:
    assert Evaluator(FindingsConfig())._steady.hold_seconds == FindingsConfig().hold_seconds == 60.0
    assert Evaluator(FindingsConfig(hold_seconds=5.0))._steady.hold_seconds == 5.0


def test_a_straggler_is_raised_only_once_its_evidence_lasted_the_confirm_time() -> None:
    steady = Steady(hold_seconds=60.0, confirm_seconds=15.0)
    # one evaluation on the line (a healthy rank on a loaded node), then none: never raised
    assert steady([STRAGGLER], 0.0, LIVE) == []
    assert steady([], 1.0, LIVE) == []
    # a run broken at t = 14 starts over: the confirm time counts from t = 15
    assert all(steady([STRAGGLER], float(t), LIVE) == [] for t in range(2, 14))
    assert steady([], 14.0, LIVE) == []
    assert all(steady([STRAGGLER], float(t), LIVE) == [] for t in range(15, 30))
    assert steady([STRAGGLER], 30.0, LIVE) == [STRAGGLER]
    # confirmed, then held as before: a missed evaluation leaves no gap
    assert steady([], 31.0, LIVE) == [STRAGGLER]
    assert steady([STRAGGLER], 32.0, LIVE) == [STRAGGLER]
    # other kinds are not confirmed, only held
    bound = Finding("dataloader_bound", "j", "1", "warning", "rank 1 waits for data")
    assert steady([bound], 40.0, LIVE) == [bound, STRAGGLER]


def test_the_evaluator_confirms_with_the_configured_time() -> None:
    assert Evaluator(FindingsConfig())._steady.confirm_seconds == FindingsConfig().straggler_confirm_seconds == 10.0
    assert Evaluator(FindingsConfig(straggler_confirm_seconds=0.0))._steady.confirm_seconds == 0.0


def test_an_arrival_straggler_is_held_in_an_agent_without_stacks() -> None:
    """The probes alone (`--no-stacks`): a rank they measure is still measured, so the
    straggler named from its arrivals is held through an evaluation that dips under the
    line, and goes once its rank is no longer measured."""
    from profagent.contracts import ArrivalStraggler, RankSteps, TimelineSnapshot

    def rank(name: str) -> RankSteps:
        return RankSteps("j", name, 10 + int(name), 100, 99, 2.0, (0,) * 15, {}, 100, 500, 50, 0.05, 0.06, 0.07, 20.0,
                         1.0, {}, "", 0.01, 0.01, (0,) * 15, 0.0, 0)

    def snapshot(step_last_share: float, ranks: tuple[str, ...] = ("0", "1")) -> dict[str, object]:
        s = ArrivalStraggler("j", "1", 0.5, 0.001, 0.02, 0.001, 0.05, 2000, 60.0, step_last_share, 1000, 0.02)
        return {"timeline": TimelineSnapshot(tuple(rank(r) for r in ranks), (s,))}

    evaluator = Evaluator(FindingsConfig(straggler_confirm_seconds=10.0))
    named = [[f.rank for f in evaluator.evaluate(snapshot(0.9), float(t)).findings] for t in range(0, 12)]
    assert named[0] == [] and named[-1] == ["1"]  # confirmed after 10 s of evidence
    assert [f.rank for f in evaluator.evaluate(snapshot(0.55), 12.0).findings] == ["1"]  # held
    assert evaluator.evaluate(snapshot(0.55, ("0",)), 13.0).findings == ()  # its rank ended

"""Incident decisions with an injected clock: triggers, rate limits, one capture at a time, retention."""

from __future__ import annotations

from profagent.analysis.incidents import (
    IncidentGate,
    LatestTrace,
    RegressionDetector,
    Retention,
    Stored,
    Trigger,
    diagnosis,
    hang_triggers,
    self_profiling,
    to_remove,
)
from profagent.contracts import Finding, FindingsSnapshot


def hang(job: str, rank: str, since: float) -> Finding:
    return Finding("hang", job, rank, "critical", f"rank {rank} hangs", {}, since)


def test_hang_triggers_one_per_job_naming_the_earliest_hung_rank() -> None:
    snap = FindingsSnapshot((
        hang("j1", "0", 20.0), hang("j1", "1", 10.0), hang("j2", "3", 5.0),
        Finding("straggler", "j3", "0", "warning", "slow"),
    ), 30.0)
    triggers = hang_triggers(snap)
    assert [(t.kind, t.job_id, t.rank) for t in triggers] == [("hang", "j1", "1"), ("hang", "j2", "3")]
    assert triggers[0].evidence["ranks"] == ["1", "0"]
    assert [f["rank"] for f in triggers[0].evidence["other_findings"]] == ["0"]
    assert hang_triggers(None) == [] and hang_triggers(FindingsSnapshot()) == []


def test_hang_trigger_holds_the_findings_whole_evidence_and_names_a_job_level_culprit() -> None:
    evidence = {"culprit_ranks": ["2"], "culprit_locations": {"2": "train.py:125"}, "waiting_ranks": ["0", "1"],
                "unchanged_seconds": 130.0, "stacks": {"0": ["all_reduce (distributed_c10d.py:3252)"]}}
    [t] = hang_triggers(FindingsSnapshot((Finding("hang", "j", None, "critical", "ranks 0, 1 wait", evidence, 7.0),), 9.0))
    assert t.rank == "2"  # a job-level finding: its first culprit
    assert {k: t.evidence[k] for k in evidence} == evidence and t.evidence["since"] == 7.0


def test_diagnosis_ignores_what_only_ages() -> None:
    a = Trigger("hang", "j", "1", "rank 1 is stuck at f (t.py:3) (stack unchanged for 120 s, not in a collective)")
    older = Trigger("hang", "j", "1", a.reason.replace("120 s", "131 s"), {"unchanged_seconds": 131})
    assert diagnosis(a) == diagnosis(older)
    assert diagnosis(a) != diagnosis(Trigger("hang", "j", "1", "ranks 0 wait in all_reduce; the culprit is not in it: rank 1"))
    assert diagnosis(a) != diagnosis(Trigger("hang", "j", "0", a.reason))


def test_gate_restored_after_a_restart_still_rate_limits() -> None:
    gate = IncidentGate(period=900.0)
    h = Trigger("hang", "j", "1", "hang")
    assert actions(gate, [h], 1000.0) == [("j", "capture")]
    saved = gate.export(1200.0)
    assert saved == {("hang", "j"): 1000.0}
    restarted = IncidentGate(period=900.0)
    restarted.restore(saved, 1270.0)  # 4.5 min later, the same hang still on
    assert actions(restarted, [h], 1270.0) == [("j", "rate_limited")]
    assert gate.export(1900.0) == {}  # past the period: nothing to keep
    future = IncidentGate(period=900.0)
    future.restore({("hang", "j"): 10**12}, 1000.0)  # a time in the future counts as now
    assert future.retry_after(("hang", "j"), 1000.0) == 900.0


def test_gate_with_per_trigger_slots_captures_several_jobs_at_once() -> None:
    gate = IncidentGate(period=100.0)
    taken: list[str] = []

    def busy(key: tuple[str, str]) -> bool:
        if key[1] == "b":  # b's user already has a capture running
            return True
        taken.append(key[1])
        return False

    a, b, c = (Trigger("hang", j, "0", "") for j in "abc")
    assert actions(gate, [a, b, c], 0.0, busy=busy) == [("a", "capture"), ("b", "busy"), ("c", "capture")]
    assert taken == ["a", "c"]
    assert actions(gate, [a, b, c], 1.0, busy=busy) == [("b", "busy")]
    gate2 = IncidentGate(period=100.0)
    assert actions(gate2, [a], 0.0) == [("a", "capture")]
    assert actions(gate2, [], 1.0) == [] and actions(gate2, [a], 2.0, busy=busy) == [("a", "rate_limited")]
    assert taken == ["a", "c"]  # a rate-limited trigger never takes a slot


def actions(gate: IncidentGate, triggers: list[Trigger], now: float, busy: bool = False) -> list[tuple[str, str]]:
    return [(d.trigger.job_id, d.action) for d in gate.offer(triggers, busy, now)]


def test_gate_fires_once_per_episode_and_rate_limits_repeated_hangs() -> None:
    gate = IncidentGate(period=100.0)
    h = Trigger("hang", "j", "1", "hang")
    assert actions(gate, [h], 0.0) == [("j", "capture")]
    assert actions(gate, [h], 1.0) == []  # same episode: nothing new
    assert actions(gate, [], 2.0) == []  # recovered
    assert actions(gate, [h], 3.0) == [("j", "rate_limited")]  # hangs again within the period
    for t in range(4):  # hang and recover repeatedly inside the period: never a capture
        assert actions(gate, [], 10.0 + 2 * t) == []
        assert actions(gate, [h], 11.0 + 2 * t) == [("j", "rate_limited")]
    assert actions(gate, [h], 150.0) == []  # still that suppressed episode, even after the period
    assert actions(gate, [], 160.0) == []
    assert actions(gate, [h], 200.0) == [("j", "capture")]  # 200 s after the first capture


def test_gate_limits_are_per_job_and_kind() -> None:
    gate = IncidentGate(period=100.0)
    assert actions(gate, [Trigger("hang", "a", "0", "")], 0.0) == [("a", "capture")]
    assert actions(gate, [Trigger("hang", "a", "0", ""), Trigger("regression", "a", "0", "")], 1.0, busy=False) == [("a", "capture")]
    assert actions(gate, [Trigger("hang", "b", "0", "")], 2.0) == [("b", "capture")]


def test_gate_never_starts_a_second_capture_and_retries_a_pending_trigger() -> None:
    gate = IncidentGate(period=100.0)
    a, b = Trigger("hang", "a", "0", ""), Trigger("hang", "b", "0", "")
    assert actions(gate, [a, b], 0.0) == [("a", "capture"), ("b", "busy")]  # one capture per tick
    assert actions(gate, [a, b], 1.0, busy=True) == [("b", "busy")]  # a's capture still runs
    assert actions(gate, [a, b], 2.0, busy=False) == [("b", "capture")]  # pending, not lost


def test_manual_requests_are_rate_limited_per_job() -> None:
    gate = IncidentGate(period=60.0)
    assert gate.ask(("manual", "j"), busy=False, now=0.0) == "capture"
    assert gate.ask(("manual", "j"), busy=False, now=10.0) == "rate_limited"
    assert gate.retry_after(("manual", "j"), 10.0) == 50.0
    assert gate.ask(("manual", "j"), busy=True, now=70.0) == "busy"
    assert gate.ask(("manual", "j"), busy=False, now=70.0) == "capture"


def test_regression_needs_a_baseline_then_factor_for_the_configured_time() -> None:
    det = RegressionDetector(factor=2.0, seconds=30.0)
    for i, step in enumerate([1.0, 1.1, 0.9]):
        det.observe("j", "0", step, at=float(i))
    assert det.baseline("j", "0") == 1.0
    det.observe("j", "0", 5.0, at=2.0)  # the same trace again: ignored
    assert det.triggers(100.0) == []
    det.observe("j", "0", 2.5, at=10.0)  # slow since t=10
    assert det.triggers(20.0) == []  # slow for 10 s < 30 s
    det.observe("j", "0", 2.6, at=30.0)
    [t] = det.triggers(40.0)
    assert (t.kind, t.job_id, t.rank) == ("regression", "j", "0")
    assert t.evidence["baseline_seconds"] == 1.0 and t.evidence["slow_since"] == 10.0
    det.observe("j", "0", 1.05, at=50.0)  # back to normal: the episode ends
    assert det.triggers(60.0) == []
    assert det.baseline("j", "0") == (1.0 + 1.05) / 2  # median of 1.0, 1.1, 0.9, 1.05: slow traces never joined


def test_regression_below_the_factor_or_too_short_history_is_no_regression() -> None:
    det = RegressionDetector(factor=2.0, seconds=0.0)
    det.observe("j", "0", 1.0, at=0.0)
    det.observe("j", "0", 10.0, at=1.0)  # no baseline yet: joins it
    assert det.triggers(2.0) == []
    det.observe("j", "0", 1.0, at=2.0)
    det.observe("j", "0", 1.9, at=3.0)  # median of 1, 10, 1 is 1: 1.9 < 2x
    assert det.triggers(4.0) == []
    det.forget([])
    assert det.baseline("j", "0") is None


def test_retention_removes_the_oldest_first_within_count_and_bytes() -> None:
    stored = [Stored("c", 30.0, 10), Stored("a", 10.0, 10), Stored("b", 20.0, 10), Stored("d", 40.0, 10)]
    assert to_remove(stored, max_count=2, max_bytes=1000) == ["a", "b"]
    assert to_remove(stored, max_count=10, max_bytes=25) == ["a", "b"]
    assert to_remove(stored, max_count=10, max_bytes=40) == []
    assert to_remove([Stored("big", 1.0, 10**9)], max_count=1, max_bytes=10) == []  # the newest stays
    assert to_remove([Stored("old", 1.0, 5), Stored("big", 2.0, 10**9)], 5, 10) == ["old"]


def test_retention_per_job_and_per_user_evicts_only_the_heavy_users_own() -> None:
    victim = Stored("v", 1.0, 10, "victim", 0)
    attack = [Stored(f"a{i}", 2.0 + i, 10, f"job{i % 5}", 65534) for i in range(10)]
    caps = Retention(max_count=4, max_bytes=10**6, max_count_per_job=1, max_count_per_user=3)
    removed = to_remove([victim, *attack], caps)
    assert "v" not in removed and sorted(set(s.id for s in attack) - set(removed)) == ["a7", "a8", "a9"]
    # no per-user cap: over the global cap, the user holding the most loses its oldest
    removed = to_remove([victim, *attack], Retention(max_count=4, max_bytes=10**6))
    assert "v" not in removed and len(removed) == 7
    # bytes: the user holding the most bytes pays, each user's newest stays under its own cap
    big = [Stored(f"b{i}", 2.0 + i, 100, "j", 65534) for i in range(3)]
    assert to_remove([victim, *big], Retention(max_count=10, max_bytes=150)) == ["b0", "b1"]
    assert to_remove([victim, *big], Retention(10, 10**6, max_bytes_per_user=150)) == ["b0", "b1"]


def test_self_profiling_ranks_are_those_whose_own_profiler_wrote_recently() -> None:
    now = 10_000.0
    latest = [
        LatestTrace("job", "0", "/t/profagent_r_11.json", True, now - 5),  # on demand: not its own profiler
        LatestTrace("job", "1", "/t/rank1.123.pt.trace.json.gz", False, now - 30),
        LatestTrace("job", "2", "/t/rank2.1.pt.trace.json.gz", False, now - 601),  # too long ago
        LatestTrace("other", "3", "/t/rank3.1.pt.trace.json.gz", False, now - 1),  # another job
        LatestTrace("", "4", "/t/rank4.1.pt.trace.json.gz", False, now),  # attach mode: no job label
    ]
    assert sorted(self_profiling(latest, "job", now)) == ["1", "4"]
    assert sorted(self_profiling(latest, "job", now, window=700)) == ["1", "2", "4"]
    assert self_profiling(latest, "job", now)["1"].file.endswith("rank1.123.pt.trace.json.gz")

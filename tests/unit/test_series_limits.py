"""Issue 41 item 5 in pure parts: which series /metrics leaves out (expired ranks, the
per-job cap) and when NodeTarget expires an exited rank (an injected clock)."""

from __future__ import annotations

from pathlib import Path

from profagent.contracts import ProcessInfo
from profagent.exporters.exposition import limit_series
from profagent.exporters.families import Families
from profagent.target.node import Limits, NodeTarget, Rules


def _families(jobs: dict[str, int], per_rank: int) -> Families:
    out = Families()
    fam = out.gauge("profagent_x", "x", ("job_id", "rank", "n"))
    for job, ranks in jobs.items():
        for rank in range(ranks):
            for n in range(per_rank):
                fam.add_metric([job, str(rank), str(n)], 1)
    out.gauge("profagent_up", "up", ("job_id",)).add_metric(["a"], 1)
    return out


def _kept(out: Families, job: str) -> set[str]:
    return {s.labels["rank"] for m in out for s in m.samples if s.labels.get("job_id") == job and "rank" in s.labels}


def test_expired_ranks_are_left_out_and_nothing_is_counted_as_dropped() -> None:
    out = _families({"a": 3, "b": 3}, 2)
    dropped = limit_series(out, frozenset({("a", "1")}), cap=1000)
    assert dropped == {}
    assert _kept(out, "a") == {"0", "2"} and _kept(out, "b") == {"0", "1", "2"}


def test_the_cap_keeps_a_jobs_lowest_ranks_and_counts_the_rest_per_job() -> None:
    out = _families({"a": 12, "b": 2}, 10)  # a: 120 series and one without a rank; b: 20
    dropped = limit_series(out, frozenset(), cap=50)
    # a's series without a rank (1) stay; ranks 0-3 fit (41), rank 4 would make 51
    assert _kept(out, "a") == {"0", "1", "2", "3"}
    assert dropped == {"a": 80}
    assert _kept(out, "b") == {"0", "1"}  # another job is not touched
    assert sum(1 for m in out for s in m.samples if s.labels.get("job_id") == "a") == 41



def _proc(rank: str, job: str = "j") -> ProcessInfo:
    return ProcessInfo(100 + int(rank), 1, 0.0, "main", rank, rank, "4", "python", job_id=job)


def test_an_exited_rank_expires_after_the_expiry_not_when_its_job_ends(tmp_path: Path) -> None:
    now = [0.0]
    target = NodeTarget(Rules(None, (), False), Limits(), proc_root=tmp_path, clock=lambda: now[0])
    assert target._expire_ranks([_proc("0"), _proc("1")], {"j"}, now[0], 60.0) == frozenset()
    now[0] = 29.0  # rank 1 last seen at 29 s
    assert target._expire_ranks([_proc("0"), _proc("1")], {"j"}, now[0], 60.0) == frozenset()
    now[0] = 30.0
    assert target._expire_ranks([_proc("0")], {"j"}, now[0], 60.0) == frozenset()
    now[0] = 88.0
    assert target._expire_ranks([_proc("0")], {"j"}, now[0], 60.0) == frozenset()
    now[0] = 89.5  # 60 s after rank 1 was last seen, while rank 0 runs on
    assert target._expire_ranks([_proc("0")], {"j"}, now[0], 60.0) == frozenset({("j", "1")})
    now[0] = 91.0  # rank 1 comes back (a restarted worker): not expired any more
    assert target._expire_ranks([_proc("0"), _proc("1")], {"j"}, now[0], 60.0) == frozenset()
    now[0] = 200.0  # the job is no longer listed: nothing of it is remembered
    assert target._expire_ranks([], set(), now[0], 60.0) == frozenset()
    assert target._rank_seen == {} and target._expired == {}

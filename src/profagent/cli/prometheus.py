"""`profagent diagnose --prometheus URL`: one answer per job across nodes, from Prometheus.

Each node's agent sees its own ranks only; Prometheus (or Thanos, Mimir) scrapes them all,
so the job's verdict is assembled here from three instant queries (``queries``).
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlencode, urlunsplit

from profagent.cli.client import NO_AUTH, ClientAuth, JsonClient, parse_agent_url
from profagent.errors import UserError

# Everything in the answer comes from labels that the watched jobs chose: it is bounded here
# (count of series, bytes of the answer) and escaped where it is printed.
MAX_ANSWER_BYTES = 32 << 20  # one query's JSON
MAX_SERIES = 20_000  # series per query taken into account (a cluster's findings are far fewer)
NO_CULPRIT = "no culprit seen on any node: a collective mismatch or the network"
SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}


def _selector(name: str, job: str | None, extra: str = "") -> str:
    matchers = [m for m in (extra, f"job_id={json.dumps(job, ensure_ascii=False)}" if job is not None else "") if m]
    return f"{name}{{{', '.join(matchers)}}}" if matchers else name


# Each node's agent sees its own ranks only: in a hang over two nodes, the node with the
# culprit names it, the other sees ranks waiting in a collective. Prometheus (or Thanos,
# Mimir: the same HTTP API) scrapes them all, so the verdict for the job is assembled here
# from three instant queries:
#
# - ``profagent_finding == 1``: every active finding, with its node (``instance``);
# - ``profagent_hang_rank_info``: each hung rank's part (culprit, waiting) and line;
# - ``profagent_finding_since_timestamp_seconds``: when each finding began.
def queries(job: str | None) -> dict[str, str]:
    """The instant queries of a verdict (``job``: only that job_id). json.dumps quotes a job
    id as PromQL reads a string, so no job id can change the query."""
    return {
        "findings": f"{_selector('profagent_finding', job)} == 1",
        "roles": _selector("profagent_hang_rank_info", job),
        "since": _selector("profagent_finding_since_timestamp_seconds", job),
    }


def query_url(base: str, expr: str) -> str:
    parts = parse_agent_url(base)
    path = parts.path.rstrip("/") + "/api/v1/query"
    return urlunsplit((parts.scheme, parts.netloc, path, urlencode({"query": expr}), ""))


def fetch_series(base: str, expr: str, auth: ClientAuth = NO_AUTH, timeout: float = 10.0) -> list[dict[str, str]]:
    """The label sets of an instant query's vector (values dropped). UserError for an
    unreachable server, a refused login, an error answer or anything but a vector."""
    fix = "check --prometheus: the Prometheus (or Thanos, Mimir) URL, e.g. http://prometheus:9090"
    client = JsonClient(base, auth, what="Prometheus", timeout=timeout, reach_fix=fix)
    status, raw = client.get("/api/v1/query", {"query": expr}, limit=MAX_ANSWER_BYTES)
    if status == 401:
        raise UserError(f"{client.shown} refused the credentials", "pass --basic-auth USER:PASS (or --basic-auth-file)")
    if status != 200:
        raise UserError(f"{client.shown} answered HTTP {status} to {expr}", fix)
    if len(raw) > MAX_ANSWER_BYTES:
        raise UserError(f"{client.shown} answered more than {MAX_ANSWER_BYTES >> 20} MiB to {expr}", "narrow it with --job ID")
    try:
        body = json.loads(raw)
    except ValueError:
        raise UserError(f"{client.shown} did not answer JSON", fix) from None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, dict) or body.get("status") != "success" or data.get("resultType") != "vector" \
            or not isinstance(data.get("result"), list):
        raise UserError(f"{client.shown} did not answer an instant vector to {expr}", fix)
    return [_labels(item) for item in data["result"][:MAX_SERIES] if isinstance(item, dict)]


def _labels(item: Mapping[str, Any]) -> dict[str, str]:
    metric = item.get("metric")
    labels = {str(k): str(v) for k, v in metric.items()} if isinstance(metric, dict) else {}
    value = item.get("value")
    if isinstance(value, list) and len(value) == 2:
        labels["__value__"] = str(value[1])
    return labels


def _rank_key(rank: str) -> tuple[int, int, str]:
    return (0, int(rank), "") if rank.isdigit() else (1, 0, rank)


def _number(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and value == value else None  # NaN: unknown


# A job's ``hang`` findings of every node become one: its culprits are the ranks any node
# named, each with its ``instance`` and ``location``; when no node saw one, it says so (a
# collective mismatch, or the network). Other findings are listed per node and rank, with
# the ``profagent diagnose --url`` that shows their evidence, each value shell-quoted (a
# job id or an instance is any string: ``x $(curl ...|sh) #`` must stay one argument).
def verdict(findings: Iterable[Mapping[str, str]], roles: Iterable[Mapping[str, str]],
            since: Iterable[Mapping[str, str]], now: float) -> dict[str, Any]:
    """The findings of every job (pure): a job's hang findings on all nodes become one."""
    began: dict[tuple[str, str, str, str, str], float] = {}
    for s in since:
        key = (s.get("cluster", ""), s.get("job_id", ""), s.get("instance", ""), s.get("rank", ""), s.get("finding", ""))
        value = _number(s.get("__value__"))
        if value is not None:
            began[key] = value

    hung: dict[tuple[str, str], dict[str, Any]] = {}
    out: list[dict[str, Any]] = []
    for f in findings:
        cluster, job_id, instance = f.get("cluster", ""), f.get("job_id", ""), f.get("instance", "")
        rank, name = f.get("rank", ""), f.get("finding", "")
        start = began.get((cluster, job_id, instance, rank, name), now)
        if name == "hang":
            job = hung.setdefault((cluster, job_id), {"instances": set(), "since": start})
            job["instances"].add(instance)
            job["since"] = min(job["since"], start)
            continue
        out.append({
            "finding": name, "job_id": job_id, "rank": rank or None, "severity": f.get("severity", ""),
            "instance": instance, "culprit_ranks": [rank] if rank else [], "culprits": [], "since": start,
            "summary": f"{name} on {'rank ' + rank if rank else 'the job'} at {instance}",
            "evidence": {"details": shlex.join(["profagent", "diagnose", "--url", f"http://{instance}", "--job", job_id])},
            **({"cluster": cluster} if cluster else {}),
        })

    parts: dict[tuple[str, str], list[Mapping[str, str]]] = {}
    for r in roles:
        parts.setdefault((r.get("cluster", ""), r.get("job_id", "")), []).append(r)
    for (cluster, job_id), job in hung.items():
        out.append(_hang(cluster, job_id, sorted(job["instances"]), job["since"], parts.get((cluster, job_id), [])))
    out.sort(key=lambda f: (SEVERITY_RANK.get(f["severity"], 3), f["job_id"], f["finding"],
                            _rank_key(f["rank"] or ""), f.get("instance", "")))
    return {"findings": out, "time": now}


def _hang(cluster: str, job_id: str, instances: list[str], since: float, roles: list[Mapping[str, str]]) -> dict[str, Any]:
    culprits = sorted(({"rank": r.get("rank", ""), "instance": r.get("instance", ""), "location": r.get("location", "?")}
                       for r in roles if r.get("hang_role") == "culprit"),
                      key=lambda c: (_rank_key(c["rank"]), c["instance"]))
    waiting = sorted({r.get("rank", "") for r in roles if r.get("hang_role") == "waiting"}, key=_rank_key)
    diagnoses = sorted({r.get("diagnosis", "") for r in roles} - {""})
    ranks = [c["rank"] for c in culprits]
    if culprits:
        at = "; ".join(f"rank {c['rank']} on {c['instance']} at {c['location']}" for c in culprits)
        summary = f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(ranks)} {'holds' if len(ranks) == 1 else 'hold'} " \
                  f"the job up, not in a collective: {at}"
    else:
        summary = NO_CULPRIT
    if waiting:
        summary += f"; {'rank' if len(waiting) == 1 else 'ranks'} {', '.join(waiting)} wait in a collective"
    return {
        "finding": "hang", "job_id": job_id, "rank": ranks[0] if len(ranks) == 1 else None, "severity": "critical",
        "instance": culprits[0]["instance"] if len(culprits) == 1 else None,
        "culprit_ranks": ranks, "culprits": culprits, "since": since, "summary": summary,
        "evidence": {"culprits": [f"rank {c['rank']} on {c['instance']} at {c['location']}" for c in culprits],
                     "waiting_ranks": waiting, "diagnoses": diagnoses, "nodes": instances},
        **({"cluster": cluster} if cluster else {}),
    }


def diagnose(base: str, job: str | None, auth: ClientAuth = NO_AUTH) -> dict[str, Any]:
    """The verdict of every job (or ``job``) that Prometheus at ``base`` knows of now."""
    q = queries(job)
    answers = {name: fetch_series(base, expr, auth) for name, expr in q.items()}
    body = verdict(answers["findings"], answers["roles"], answers["since"], time.time())
    body["prometheus"] = parse_agent_url(base).geturl()
    return body

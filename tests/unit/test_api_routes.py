"""The API wing: ``ROUTES`` and docs/openapi.yaml name the same /api/* paths, every row builds
a handler whose answers the file documents, and /api/stacks over real stack rings."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jsonschema
import yaml

from helpers.paths import ROOT
from profagent.contracts import Finding, FindingsSnapshot, ProcessInfo, ProcessTree, StateView
from profagent.engine.incidents.store import IncidentStore
from profagent.exporters.api import ROUTES, ApiProviders
from profagent.exporters.api.stacks import stacks_route
from profagent.sources.stacks.ring import StackRing
from profagent.state import State

SPEC = yaml.safe_load((ROOT / "docs" / "openapi.yaml").read_text())
JOB = "job-7"


def test_routes_table_is_what_docs_openapi_yaml_documents() -> None:
    documented = {path for path in SPEC["paths"] if path.startswith("/api/")}
    assert len(documented) >= 4  # the file was read: findings, incidents, ranks, stacks at least
    assert set(ROUTES) == documented, (sorted(ROUTES), sorted(documented))


def answer_as_documented(path: str, answer: tuple[int, str, bytes]) -> object:
    """The status and content type are in the file for ``path``; a JSON body validates."""
    status, ctype, body = answer
    responses = SPEC["paths"][path]["get"]["responses"]
    assert str(status) in responses, f"{path}: {status} is not documented"
    content = responses[str(status)]["content"]
    media = ctype.split(";")[0].strip()
    assert media in content, f"{path}: {status} answered {media}, documented {sorted(content)}"
    if media != "application/json":
        return body.decode()
    document = json.loads(body)
    jsonschema.Draft202012Validator({**content[media]["schema"], "components": SPEC["components"]}).validate(document)
    return document


class Ring:
    """A job's stacks as /api/stacks reads them: a real StackRing, the source's way of folding."""

    def __init__(self, ring_seconds: float, wall: float) -> None:
        self.ring, self.ring_seconds, self.wall, self.looks = StackRing(), ring_seconds, wall, 0

    def ranks(self) -> list[tuple[str, str]]:
        return self.ring.ranks()

    def folded(self, rank: str, seconds: float, job_id: str | None = None) -> str:
        return self.ring.folded(rank, self.wall - seconds, job_id)

    def watched(self) -> None:
        self.looks += 1


def window(ring: Ring, job: str, rank: str, end: float, stack: str, count: int) -> None:
    from profagent.analysis.stacks import Sample

    ring.ring.add((job, rank), end, [Sample("MainThread", True, (), count, stack)], 1e9)


class Recorder:
    """A timeline source as /api/timeline reads it: real RankTimelines fed a few steps."""

    def __init__(self) -> None:
        from profagent.analysis import timeline as tl

        self.timeline = tl.RankTimeline()
        for i in range(5):
            self.timeline.feed(tl.STEP, 1, 10.0 + i * 0.1)
            self.timeline.feed(tl.RECORD_EXIT, 1, 10.01 + i * 0.1)
            self.timeline.feed(tl.BACKWARD, 1, 10.05 + i * 0.1)
            self.timeline.feed(tl.COLLECTIVE, 1, 10.06 + i * 0.1)
            self.timeline.feed(tl.BACKWARD_END, 1, 10.08 + i * 0.1)
        self.asked: list[tuple] = []

    def history(self, seconds: float, node: str = "", ranks=(), job: str | None = None):  # noqa: ANN001, ANN201
        from profagent.analysis.timeline_picture import rank_history
        from profagent.contracts import TimelineHistory

        self.asked.append((seconds, node, sorted(ranks), job))
        return TimelineHistory(node, 10.5, 1.7e9, (rank_history(self.timeline, JOB, "0", 10, node, 10.5, 10.5 - seconds),))


def test_every_row_builds_a_handler_that_answers_as_documented(tmp_path: Path) -> None:
    """Each row of the table over real parts: a State with a job, a findings snapshot, an
    incidents folder with a bundle of this job and one of another, a stack ring."""
    state = State(clock=lambda: 1000.0)
    state.set_tree(ProcessTree(JOB, 10, (ProcessInfo(10, 1, 0.0, "main", "0", "0", "1", "train.py", JOB),), True))
    hang = Finding("hang", JOB, "0", "critical", "rank 0 stands still", {}, since=990.0)
    state.publish("findings", FindingsSnapshot((hang,), 1000.0, evaluations=3), 0.01)
    store = IncidentStore(tmp_path / "incidents")
    for job in (JOB, "other"):
        folder = store.create("manual", job, 1000.0)
        (folder / "incident.json").write_text(json.dumps({"id": folder.name, "kind": "manual", "job_id": job,
                                                          "time": 1000.0, "status": "complete"}))
        (folder / "summary.md").write_text(f"# manual incident of {job}\n")
    ring = Ring(ring_seconds=600.0, wall=1000.0)
    window(ring, JOB, "0", 999.0, "main (t.py:1);step (t.py:9)", 7)
    watched: list[float] = []
    views: list[StateView] = [state.view()]
    providers = ApiProviders(
        node="node-a", views=lambda: views, watched=lambda: watched.append(time.monotonic()),
        stacks=lambda: [ring], findings=lambda: [state.view().findings], incidents=store.list,
        job_ids=lambda: [JOB], timeline=lambda: [recorder])
    recorder = Recorder()
    routes = {path: build(providers) for path, build in ROUTES.items()}

    findings = answer_as_documented("/api/findings", routes["/api/findings"]({}))
    assert [(f["finding"], f["rank"]) for f in findings["findings"]] == [("hang", "0")]
    assert findings["evaluations"] == 3

    listed = answer_as_documented("/api/incidents", routes["/api/incidents"]({}))
    mine = listed["incidents"]
    assert [i["job_id"] for i in mine] == [JOB]  # the other job's bundle is not this agent's
    detail = answer_as_documented("/api/incidents", routes["/api/incidents"]({"id": [mine[0]["id"]]}))
    assert detail["summary"] == f"# manual incident of {JOB}\n"
    assert {f["name"] for f in detail["files"]} == {"incident.json", "summary.md"}

    ranks = answer_as_documented("/api/ranks", routes["/api/ranks"]({}))
    assert ranks["node"] == "node-a" and [r["rank"] for j in ranks["jobs"] for r in j["ranks"]] == ["0"]
    assert len(watched) == 1  # `top --url` polling /api/ranks keeps py-spy at the full rate

    stacks = answer_as_documented("/api/stacks", routes["/api/stacks"]({"rank": ["0"]}))
    assert stacks == "main (t.py:1);step (t.py:9) 7\n" and ring.looks == 1

    picture = answer_as_documented("/api/timeline", routes["/api/timeline"]({"seconds": ["30"], "rank": ["0"]}))
    assert picture["otherData"]["nodes"] == ["node-a"]
    assert [e["args"]["step"] for e in picture["traceEvents"] if e.get("cat") == "step"] == [1, 2, 3, 4, 5]
    history = answer_as_documented("/api/timeline", routes["/api/timeline"]({"format": ["history"]}))
    assert history["clock_offset"] == 1.7e9 and len(history["ranks"][0]["steps"]) == 4
    assert recorder.asked == [(30.0, "node-a", ["0"], None), (60.0, "node-a", [], None)]
    for bad in ({"seconds": ["x"]}, {"seconds": ["0"]}, {"format": ["svg"]}):
        assert answer_as_documented("/api/timeline", routes["/api/timeline"](bad)) and routes["/api/timeline"](bad)[0] == 400


def test_routes_answer_as_documented_when_their_parts_are_off(tmp_path: Path) -> None:
    """Stacks source off and findings engine off: 503; an empty incidents folder; no job yet."""
    providers = ApiProviders(node="node-a", views=lambda: [State().view()], watched=lambda: None,
                             stacks=lambda: [], findings=lambda: [],
                             incidents=IncidentStore(tmp_path / "none").list, job_ids=None)
    routes = {path: build(providers) for path, build in ROUTES.items()}
    assert routes["/api/stacks"]({})[0] == 503
    answer_as_documented("/api/stacks", routes["/api/stacks"]({}))
    assert routes["/api/findings"]({})[0] == 503
    answer_as_documented("/api/findings", routes["/api/findings"]({}))
    assert routes["/api/timeline"]({})[0] == 503
    answer_as_documented("/api/timeline", routes["/api/timeline"]({}))
    assert answer_as_documented("/api/incidents", routes["/api/incidents"]({})) == {"incidents": []}
    assert routes["/api/incidents"]({"id": ["nope"]})[0] == 404
    assert answer_as_documented("/api/ranks", routes["/api/ranks"]({}))["jobs"] == []


def test_stacks_route_over_two_jobs() -> None:
    """A rank number in two jobs needs job=J; seconds are capped at the ring's length; a
    rank known to the second job's source is asked of that source."""
    a, b = Ring(ring_seconds=30.0, wall=1000.0), Ring(ring_seconds=30.0, wall=1000.0)
    window(a, "A", "0", 960.0, "old (t.py:1)", 2)  # 40 s ago: past the ring's 30 s
    window(a, "A", "0", 995.0, "new (t.py:2)", 3)
    window(a, "B", "0", 995.0, "other_job (t.py:3)", 4)
    window(b, "C", "5", 999.0, "fifth (t.py:4)", 1)
    route = stacks_route(lambda: [a, b])

    status, _, body = route({"rank": ["0"]})
    assert status == 400 and b"add job=J" in body and b"0 (job A)" in body
    assert route({"rank": ["0"], "job": ["A"], "seconds": ["3600"]}) == (
        200, "text/plain; charset=utf-8", b"new (t.py:2) 3\n")  # 3600 s read as the ring's 30
    assert route({"rank": ["0"], "job": ["A"], "seconds": ["-1"]})[2] == b""  # nothing ended in the future
    assert route({"rank": ["5"]})[2] == b"fifth (t.py:4) 1\n" and b.looks == 1
    assert route({"rank": ["0"], "job": ["B"], "seconds": ["x"]})[0] == 400
    assert route({"rank": ["9"]})[0] == 404
    assert route({})[0] == 400  # several ranks sampled: rank=R is required

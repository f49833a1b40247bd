"""docs/openapi.yaml describes what a live agent serves: every path the agent routes is in
the file and every path of the file is routed, and each answer (status, content type,
JSON body) validates against the file's schema for it.

JSON bodies are checked with ``jsonschema`` (OpenAPI 3.1 schemas are JSON Schema 2020-12;
the package comes with the test extra's kubernetes-validate).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import jsonschema
import pytest
import yaml

from helpers.agent import free_port, http_get
from helpers.paths import ROOT
from helpers.processes import wait_for

pytestmark = pytest.mark.slow

SPEC = yaml.safe_load((ROOT / "docs" / "openapi.yaml").read_text())

BUSY = """
import sys
def openapi_busy():
    x = 0
    while True:
        for i in range(1000):
            x += i
open(sys.argv[0] + ".ready", "w").close()
openapi_busy()
"""


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


def check(base: str, path: str, query: str = "") -> object:
    """GET path?query; the status and content type are documented, a JSON body validates.
    Returns the parsed JSON body (None for text)."""
    status, ctype, body = get(base + path + (f"?{query}" if query else ""))
    responses = SPEC["paths"][path]["get"]["responses"]
    assert str(status) in responses, f"{path}?{query}: {status} is not documented ({sorted(responses)})"
    content = responses[str(status)]["content"]
    media = ctype.split(";")[0].strip()
    assert media in content, f"{path}?{query}: {status} answered {media}, documented {sorted(content)}"
    schema = content[media]["schema"]
    if media != "application/json":
        jsonschema.validate(body.decode(), schema)
        return None
    document = json.loads(body)
    jsonschema.Draft202012Validator({**schema, "components": SPEC["components"]}).validate(document)
    return document


def test_the_live_agent_answers_as_docs_openapi_yaml_says(children, tmp_path: Path, run_agent) -> None:
    proc = children.python(BUSY)
    wait_for(lambda: (tmp_path / "child_0.py.ready").exists(), 20, what="child ready")
    incidents = tmp_path / "incidents"
    config = tmp_path / "agent.toml"
    config.write_text(f"state_dir = '{tmp_path / 'state'}'\n[incidents]\ndir = '{incidents}'\n"
                      f"[ondemand]\nenabled = false\n")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    agent = run_agent(["attach", "--pid", str(proc.pid), "--listen", f"127.0.0.1:{port}", "--config", str(config),
                       "--gpu-backend", "simulated:h100x1"])
    agent.wait_healthy(base, timeout=60)

    # Every routed path is documented, and every documented path is routed.
    routed = set(re.findall(r'href="([^"]+)"', http_get(base + "/")))
    assert routed == set(SPEC["paths"]), (sorted(routed), sorted(SPEC["paths"]))

    def sampled() -> dict | None:
        ranks = check(base, "/api/ranks")
        rows = [r for j in ranks["jobs"] for r in j["ranks"]]
        return ranks if rows and rows[0]["functions"] and rows[0]["gpu"] is not None else None

    ranks = wait_for(sampled, 60, interval=0.5, what="the rank sampled by py-spy and placed on a GPU")
    job_id = ranks["jobs"][0]["job_id"]
    check(base, "/healthz")
    check(base, "/healthz", "verbose=1")
    assert "stacks: on" in get(base + "/healthz?verbose=1")[2].decode()
    assert check(base, "/api/findings")["findings"] is not None
    check(base, "/api/findings", "job=nope")
    # /api/ranks has a first look (a thread-state dump) before the first py-spy window; the
    # folded stacks of /api/stacks come with that window.
    wait_for(lambda: "openapi_busy" in get(base + "/api/stacks?rank=0")[2].decode(), 60, interval=0.5,
             what="the first py-spy window in /api/stacks")
    check(base, "/api/stacks", "rank=0&seconds=5")
    check(base, "/api/stacks", "rank=9")  # 404
    check(base, "/api/stacks", "rank=0&seconds=x")  # 400
    check(base, "/api/timeline", "seconds=5")  # the picture (503 where the probes cannot run)
    check(base, "/api/timeline", "format=history&rank=0")
    check(base, "/api/timeline", "format=svg")  # 400
    assert check(base, "/api/incidents") == {"incidents": []}
    # A bundle of this job (as `incidents capture` leaves one) and one of another job.
    for name, job in (("20260101T000000Z-mine-manual", job_id), ("20260101T000001Z-other-manual", "other")):
        folder = incidents / name
        folder.mkdir(parents=True, mode=0o700)
        (folder / "incident.json").write_text(json.dumps({
            "id": name, "kind": "manual", "job_id": job, "time": 1767225600.0, "rank": None,
            "reason": "openapi", "status": "complete"}))
        (folder / "summary.md").write_text("# manual incident\n")
    listed = check(base, "/api/incidents")
    assert [i["id"] for i in listed["incidents"]] == ["20260101T000000Z-mine-manual"]
    detail = check(base, "/api/incidents", "id=20260101T000000Z-mine-manual")
    assert detail["summary"] == "# manual incident\n" and {f["name"] for f in detail["files"]} >= {"summary.md"}
    check(base, "/api/incidents", "id=20260101T000001Z-other-manual")  # 404: not this agent's job
    assert get(base + "/api/incidents?id=20260101T000001Z-other-manual")[0] == 404
    metrics = check(base, "/metrics")
    assert metrics is None


def test_the_spec_is_well_formed() -> None:
    """Every $ref resolves, every schema is valid JSON Schema 2020-12, and a wrong body fails."""
    validator = jsonschema.Draft202012Validator
    for schema in SPEC["components"]["schemas"].values():
        validator.check_schema(schema)
    findings = {"$ref": "#/components/schemas/Findings", "components": SPEC["components"]}
    validator(findings).validate({"findings": [], "time": 0.0})
    with pytest.raises(jsonschema.ValidationError):
        validator(findings).validate([])  # the shape /api/incidents had before 0.2 is not an object
    incidents = {"$ref": "#/components/schemas/Incidents", "components": SPEC["components"]}
    with pytest.raises(jsonschema.ValidationError):
        validator(incidents).validate({"incidents": [{"id": "x"}]})  # fields missing

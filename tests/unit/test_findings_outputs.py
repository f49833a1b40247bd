"""Where findings go (family, /api/findings route, diagnose report) and the alert-facing
health fixes (not-applicable collectors, user trace folders, attach's last scrape)."""

from __future__ import annotations

import json

from rich.console import Console

from profagent.cli.diagnose import findings_url, render
from profagent.contracts import Finding, FindingsSnapshot, TracesSnapshot
from profagent.engine.agent import FINAL_SCRAPE_WAIT, done_serving
from profagent.exporters.api.findings import findings_route
from profagent.exporters.exposition import Exposition
from profagent.exporters.families import Families, agent
from profagent.exporters.families import findings as findings_families
from profagent.exporters.families import traces as traces_families
from profagent.labels import value_max
from profagent.state import State

HANG = Finding("hang", "42", "1", "critical", "ranks 0 wait in all_reduce; the culprit is not in it: rank 1 at main (t.py:68)",
               {"stacks": {"1": ["main (t.py:68)"]}, "culprit_ranks": ["1"]}, since=100.0)
SLOW = Finding("dataloader_bound", "42", "0", "warning", "rank 0 waits for the DataLoader", {"share": 0.5}, since=90.0)
CAP = Finding("gpu_throttled", "42", None, "info", "GPU 0 at its power cap", {}, since=80.0)


def samples(out: Families, name: str) -> list[tuple[dict, float]]:
    return [(s.labels, s.value) for fam in out for s in fam.samples if s.name == name]


def test_family_has_one_series_per_active_finding() -> None:
    out = Families()
    findings_families.render(FindingsSnapshot((HANG, SLOW, CAP), 130.0), out)
    assert samples(out, "profagent_finding") == [
        ({"job_id": "42", "rank": "1", "finding": "hang", "severity": "critical"}, 1),
        ({"job_id": "42", "rank": "0", "finding": "dataloader_bound", "severity": "warning"}, 1),
        ({"job_id": "42", "rank": "", "finding": "gpu_throttled", "severity": "info"}, 1),
    ]
    assert samples(out, "profagent_finding_since_timestamp_seconds")[0] == (
        {"job_id": "42", "rank": "1", "finding": "hang"}, 100.0)


def test_route_ranks_by_severity_and_filters_by_job() -> None:
    other = Finding("straggler", "7", "3", "warning", "s", {}, 1.0)
    route = findings_route(lambda: [FindingsSnapshot((CAP, SLOW, HANG), 130.0), FindingsSnapshot((other,), 131.0), None])
    status, ctype, body = route({})
    data = json.loads(body)
    assert (status, ctype, data["time"]) == (200, "application/json", 131.0)
    assert [f["finding"] for f in data["findings"]] == ["hang", "dataloader_bound", "straggler", "gpu_throttled"]
    assert data["findings"][0] == HANG.as_dict()
    assert [f["job_id"] for f in json.loads(route({"job": ["7"]})[2])["findings"]] == ["7"]
    assert findings_route(lambda: [])({})[0] == 503


def test_engine_publishes_in_state_and_on_metrics() -> None:
    from profagent.config import FindingsConfig
    from profagent.engine.findings import FindingsEngine

    state = State(clock=lambda: 5.0)
    engine = FindingsEngine(FindingsConfig(), state, wall=lambda: 1234.0)
    snap = engine.tick()
    assert state.view().findings is snap and snap == FindingsSnapshot((), 1234.0, evaluations=1)
    body, _ = Exposition(state.view).render("")
    assert b'profagent_collector_up{collector="findings"} 1.0' in body


def test_diagnose_report_is_ranked_with_evidence() -> None:
    console = Console(record=True, width=200)
    render({"findings": [CAP.as_dict(), SLOW.as_dict(), HANG.as_dict()], "time": 130.0}, console)
    text = console.export_text()
    assert text.index("CRITICAL hang") < text.index("WARNING dataloader_bound") < text.index("INFO gpu_throttled")
    assert "job 42, rank 1, for 30 s" in text and "job 42, job, for 50 s" in text
    assert "stack of rank 1 (innermost last):" in text and "main (t.py:68)" in text
    console = Console(record=True, width=200)
    render({"findings": [], "time": 1.0}, console)
    assert "no findings" in console.export_text()


def test_findings_url_accepts_root_or_metrics() -> None:
    assert findings_url("http://n1:19400/metrics", None) == "http://n1:19400/api/findings"
    assert findings_url("n1:19400", "42") == "http://n1:19400/api/findings?job=42"
    assert findings_url("https://n1:19400/", None) == "https://n1:19400/api/findings"


def test_not_applicable_collector_is_labelled() -> None:
    state = State()
    state.register("gpu")
    state.register("stacks")
    state.set_down("gpu", "no NVIDIA driver found", not_applicable="no_gpu")
    state.set_down("stacks", "ptrace denied")
    out = Families()
    agent.render_health(state.view(), out)
    assert samples(out, "profagent_collector_not_applicable") == [({"collector": "gpu", "reason": "no_gpu"}, 1)]
    assert sorted(samples(out, "profagent_collector_up"), key=str) == sorted(
        [({"collector": "gpu"}, 0), ({"collector": "stacks"}, 0)], key=str)


def test_trace_folder_counts_as_configured_only_when_the_user_gave_one() -> None:
    for user_dirs, expected in ((True, 1), (False, 0)):
        out = Families()
        traces_families.render(TracesSnapshot("42", (), (), 0, 10, user_dirs), out)
        assert len(samples(out, "profagent_traces_dir_configured")) == expected


class Scraped:
    def __init__(self, last: float | None) -> None:
        self.last_render = last


def test_attach_waits_for_one_scrape_after_its_job_ended() -> None:
    now = 1000.0
    assert not done_serving(Scraped(None), gone_for=2.0, exit_grace=3.0, now=now)
    assert done_serving(Scraped(None), gone_for=4.0, exit_grace=3.0, now=now)  # nobody scrapes: as before
    assert not done_serving(Scraped(now - 10), gone_for=4.0, exit_grace=3.0, now=now)  # scraped before it ended
    assert done_serving(Scraped(now - 1), gone_for=4.0, exit_grace=3.0, now=now)  # a scrape saw it ended
    assert done_serving(Scraped(now - 100), gone_for=3.0 + FINAL_SCRAPE_WAIT + 1, exit_grace=3.0, now=now)


def test_diagnose_shows_each_ranks_role_in_a_hang() -> None:
    roles = {"0": {"role": "waiting", "stalled": True, "at": "x", "collective": "all_reduce from backward (DDP's reducer)"},
             "1": {"role": "culprit", "stalled": True, "at": "main (t.py:68)", "collective": None}}
    hang = Finding("hang", "42", "1", "critical", "rank 1 holds the job up", {"roles": roles}, 100.0)
    console = Console(record=True, width=200)
    render({"findings": [hang.as_dict()], "time": 130.0}, console)
    text = console.export_text()
    assert "rank 0: waiting (stalled): all_reduce from backward (DDP's reducer)" in text
    assert "rank 1: culprit (stalled): main (t.py:68)" in text


def test_hang_roles_series_names_each_rank_with_its_line_bounded() -> None:
    """profagent_hang_rank_info: one series per rank of a hang, its part and line; the
    file names come from the job, so a hostile one is escaped and bounded."""
    hostile = "x\x1b[2J" + "d/" * 400 + "t.py:9"
    roles = {"0": {"role": "waiting", "location": "t.py:70"}, "1": {"role": "culprit", "location": hostile},
             "2": {"role": "boss", "location": "t.py:1"}, "3": "not a dict"}
    hang = Finding("hang", "42", "1", "critical", "rank 1 holds the job up", {"diagnosis": "culprit", "roles": roles}, 100.0)
    rows = findings_families.hang_roles(hang)
    assert [r[:3] for r in rows] == [("0", "culprit", "waiting"), ("1", "culprit", "culprit")]
    assert rows[0][3] == "t.py:70"
    assert "\x1b" not in rows[1][3] and len(rows[1][3].encode()) <= value_max() and rows[1][3].startswith("x\\x1b")
    assert findings_families.hang_roles(Finding("hang", "42", None, "critical", "s", {"diagnosis": "made up", "roles": roles})) == []
    assert findings_families.hang_roles(Finding("straggler", "42", "1", "warning", "s", {"diagnosis": "culprit", "roles": roles})) == []

    families = Families()
    findings_families.render(FindingsSnapshot((hang,), 100.0), families)
    [info] = [f for f in families if f.name == "profagent_hang_rank_info"]
    assert sorted((s.labels["rank"], s.labels["hang_role"], s.value) for s in info.samples) == [
        ("0", "waiting", 1), ("1", "culprit", 1)]


def test_diagnose_says_where_a_ranks_steps_come_from_and_when_it_has_none() -> None:
    console = Console(record=True, width=300)
    steps = [{"job_id": "j", "rank": "0", "p50_seconds": 0.05, "p90_seconds": 0.06, "stage_shares": {"backward": 0.5},
              "step_boundary": "backward", "steps_note": "steps from backward passes: set it"},
             {"job_id": "j", "rank": "1", "p50_seconds": None, "step_boundary": "none",
              "steps_note": "no step boundary: set it"},
             {"job_id": "j", "rank": "2", "p50_seconds": 0.05, "p90_seconds": 0.06, "step_boundary": "optimizer"}]
    render({"findings": [], "time": 1.0, "steps": steps}, console)
    text = console.export_text()
    assert "rank 0: p50 50.0 ms" in text and "step boundary: backward" in text and "steps from backward passes" in text
    assert "rank 1: no step boundary: set it" in text
    assert "rank 2: p50 50.0 ms" in text and text.count("; step boundary:") == 1

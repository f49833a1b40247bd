"""The committed dashboards and provisioning files: generated, valid, linked, consistent."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from helpers.paths import ROOT
from profagent.exporters.grafana.provisioning import (
    DATASOURCE_FILE,
    DATASOURCE_UID,
    FOLDER,
    PROVIDER_FILE,
)
from profagent_dashboards.coverage import (
    NOT_ON_A_DASHBOARD,
    ONLY_AFTER_A_FAILURE,
    RECORDED_NOT_ON_A_DASHBOARD,
    recorded_names,
)
from profagent_dashboards.model import iter_panels, iter_targets, metric_names

DASHBOARDS = ROOT / "dashboards"
VARIABLES = ["datasource", "instance", "job_id", "rank", "gpu"]
# Boards built on the job-level recording rules span every node: no instance, rank or gpu.
VARIABLES_OF = {"profagent-cluster": ["datasource", "job_id"]}
BUILTIN = {"__rate_interval", "__interval", "__range", "__all"}
UIDS = {"profagent-overview", "profagent-gpus", "profagent-stacks", "profagent-traces", "profagent-agent",
        "profagent-cluster"}
# Series that Prometheus itself or the client library (the agent's own process) exports.
NOT_OURS = re.compile(r"up|scrape_[a-z_]+|process_[a-z_]+|python_[a-z_]+")


def _models() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def test_regenerating_gives_exactly_the_committed_files(tmp_path: Path) -> None:
    pytest.importorskip("grafana_foundation_sdk", reason="the generator needs the test extra")
    from profagent_dashboards.generate import files

    generated = files()
    committed = {
        str(p.relative_to(DASHBOARDS)): p.read_text(encoding="utf-8")
        for p in DASHBOARDS.rglob("*") if p.is_file()
    }
    assert sorted(generated) == sorted(committed), "run: make dashboards"
    for rel, text in generated.items():
        assert committed[rel] == text, f"{rel} is stale: run make dashboards"


def test_six_dashboards_with_stable_uids_and_current_schema() -> None:
    models = _models()
    assert {m["uid"] for m in models.values()} == UIDS
    for name, m in models.items():
        assert name == f"{m['uid']}.json"
        assert m["schemaVersion"] >= 39
        assert m["id"] is None
        assert "profagent" in m["tags"]
        assert m["title"].startswith("profagent / ")


def test_panels_have_grid_positions_unique_ids_and_the_datasource() -> None:
    for name, m in _models().items():
        ids = []
        for panel in iter_panels(m):
            ids.append(panel["id"])
            pos = panel["gridPos"]
            assert set(pos) >= {"h", "w", "x", "y"}, (name, panel["title"])
            assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, (name, panel["title"], pos)
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, (name, panel["title"])
            assert panel.get("targets"), (name, panel["title"])
            assert panel.get("description"), (name, panel["title"])
            refs = [t["refId"] for t in panel["targets"]]
            assert len(set(refs)) == len(refs) and all(refs), (name, panel["title"])
            for t in panel["targets"]:
                assert t["datasource"]["uid"] == "${datasource}"
        assert len(set(ids)) == len(ids), f"{name}: duplicate panel ids"


def test_panels_do_not_overlap() -> None:
    for name, m in _models().items():
        cells: dict[tuple[int, int], str] = {}
        for panel in m["panels"]:
            pos = panel["gridPos"]
            for x in range(pos["x"], pos["x"] + pos["w"]):
                for y in range(pos["y"], pos["y"] + pos["h"]):
                    assert (x, y) not in cells, f"{name}: {panel['title']} overlaps {cells[(x, y)]}"
                    cells[(x, y)] = panel["title"]


def test_variables_are_defined_in_order_and_none_dangles() -> None:
    for name, m in _models().items():
        variables = m["templating"]["list"]
        expected = VARIABLES_OF.get(m["uid"], VARIABLES)
        assert [v["name"] for v in variables] == expected, name
        ds = variables[0]
        assert ds["type"] == "datasource" and ds["query"] == "prometheus"
        assert ds["current"]["value"] == DATASOURCE_UID
        defined = set(expected) | BUILTIN
        text = json.dumps(m)
        used = set(re.findall(r"\$\{?([a-zA-Z_]+)", text))
        assert used <= defined, f"{name}: undefined variables {used - defined}"
        for v in variables[1:]:
            assert v["datasource"]["uid"] == "${datasource}"
            assert v["multi"] and v["includeAll"]
            query = v["query"]["query"]
            for ref in re.findall(r"\$([a-zA-Z_]+)", query):  # only earlier variables
                assert expected.index(ref) < expected.index(v["name"]), (name, v["name"], ref)
        for panel in iter_panels(m):
            if panel.get("repeat"):
                assert panel["repeat"] in defined


def test_every_dashboard_links_to_every_other() -> None:
    for name, m in _models().items():
        urls = {link["url"] for link in m["links"]}
        assert urls == {f"/d/{uid}" for uid in UIDS - {m['uid']}}, name
        assert all(link["includeVars"] and link["keepTime"] for link in m["links"]), name


def test_units_are_grafana_units_matching_the_metric_names() -> None:
    expected = {"_seconds": "s", "_bytes": "bytes", "_watts": "watt", "_celsius": "celsius", "_hertz": "hertz",
                "_ratio": "percentunit"}
    for name, m in _models().items():
        for panel in iter_panels(m):
            if panel["type"] != "timeseries":
                continue
            unit = panel["fieldConfig"]["defaults"].get("unit")
            assert unit, (name, panel["title"])
            exprs = [t["expr"] for t in panel["targets"]]
            if len(exprs) == 1 and re.fullmatch(r"[a-z_]+\{[^}]*\}", exprs[0]):  # a bare selector
                metric = exprs[0].split("{")[0]
                for suffix, grafana_unit in expected.items():
                    if metric.endswith(suffix):
                        assert unit == grafana_unit, (name, panel["title"], unit)


def test_targets_are_promql_with_legends() -> None:
    for m in _models().values():
        for t in iter_targets(m):
            assert t.expr.count("(") == t.expr.count(")"), t
            assert t.expr.count("{") == t.expr.count("}"), t


def test_provisioning_files() -> None:
    ds = yaml.safe_load((DASHBOARDS / DATASOURCE_FILE).read_text())
    assert ds["apiVersion"] == 1
    (source,) = ds["datasources"]
    assert source["uid"] == DATASOURCE_UID and source["type"] == "prometheus"
    assert source["url"] == "${PROMETHEUS_URL}"
    prov = yaml.safe_load((DASHBOARDS / PROVIDER_FILE).read_text())
    (provider,) = prov["providers"]
    assert provider["type"] == "file" and provider["folder"] == FOLDER
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/profagent"


def test_docker_compose_mounts_the_provisioning() -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"prometheus", "grafana"}
    grafana = services["grafana"]
    assert grafana["environment"]["PROMETHEUS_URL"] == "http://prometheus:9090"
    mounts = {m.split(":")[1]: m.split(":")[0] for m in grafana["volumes"]}
    base = ROOT / "deploy"
    assert (base / mounts["/etc/grafana/provisioning/datasources"]).resolve() == (DASHBOARDS / "provisioning" / "datasources").resolve()
    assert (base / mounts["/etc/grafana/provisioning/dashboards"]).resolve() == (DASHBOARDS / "provisioning" / "dashboards").resolve()
    assert (base / mounts["/var/lib/grafana/dashboards/profagent"]).resolve() == DASHBOARDS.resolve()
    prom_mounts = {m.split(":")[1]: m.split(":")[0] for m in services["prometheus"]["volumes"] if ":/" in m and m.startswith(".")}
    for outside in prom_mounts.values():
        assert (base / outside).exists(), outside
    assert prom_mounts["/etc/prometheus/alerts.yml"] == "./prometheus/alerts.yml"
    for spec in compose["volumes"]:
        assert any(v.startswith(f"{spec}:") for s in services.values() for v in s["volumes"])


def test_every_family_a_renderer_declares_is_on_a_panel_or_allowlisted() -> None:
    """Also the families a healthy simulated job never exports (MIG, XID, fan speed...).

    Renderers name families without the suffixes the client library adds (`_total`, a
    unit), so a declared name counts as covered when a used name starts with it.
    """
    source = "\n".join(p.read_text() for p in (ROOT / "src/profagent/exporters/families").glob("*.py"))
    declared = set(re.findall(r'"(profagent_[a-z0-9_]+)"', source))
    used = {name for m in _models().values() for t in iter_targets(m) for name in metric_names(t.expr)}
    covered = used | set(NOT_ON_A_DASHBOARD)
    missing = sorted(d for d in declared if not any(name == d or name.startswith(d + "_") for name in covered))
    assert not missing, f"declared by a renderer, on no panel and not in NOT_ON_A_DASHBOARD: {missing}"


def test_allowlists_name_families_that_renderers_declare() -> None:
    source = "\n".join(p.read_text() for p in (ROOT / "src/profagent/exporters/families").glob("*.py"))
    declared = set(re.findall(r'"(profagent_[a-z0-9_]+)"', source))
    for name in [*NOT_ON_A_DASHBOARD, *ONLY_AFTER_A_FAILURE]:
        if name.startswith("profagent_"):  # the others are the client library's process_* / python_*
            assert any(name == d or name.startswith(d + "_") for d in declared), f"{name}: no renderer declares it"


def _declared() -> set[str]:
    source = "\n".join(p.read_text() for p in (ROOT / "src/profagent/exporters/families").glob("*.py"))
    return set(re.findall(r'"(profagent_[a-z0-9_]+)"', source))


def test_every_query_names_a_declared_family_or_a_recorded_series() -> None:
    """A typo in a metric name gives an empty panel, not an error: catch it here. Known
    names are the renderers' families (with the client library's suffixes), the series the
    recording rules in deploy/prometheus/recording.yml define, and Prometheus' own."""
    declared = _declared()
    recorded = recorded_names()
    unknown = set()
    for m in _models().values():
        for t in iter_targets(m):
            for name in metric_names(t.expr):
                known = (name in recorded or NOT_OURS.fullmatch(name)
                         or any(name == d or name.startswith(d + "_") for d in declared))
                if not known:
                    unknown.add(f"{t.dashboard} / {t.panel}: {name}")
    assert not unknown, "\n".join(sorted(unknown))


def test_the_cluster_board_reads_only_recorded_series_and_shows_every_job_rule() -> None:
    """Its queries span every node, so each must read what the rules aggregated once, and
    every per-job rule deserves a panel (the per-rank ratio is the straggler table)."""
    recorded = recorded_names()
    (cluster,) = [m for m in _models().values() if m["uid"] == "profagent-cluster"]
    used = {name for t in iter_targets(cluster) for name in metric_names(t.expr)}
    # the straggler table shows each rank's raw step time next to its recorded ratio
    assert used - set(recorded) == {"profagent_trace_step_seconds"}
    assert set(RECORDED_NOT_ON_A_DASHBOARD) <= set(recorded)  # no stale exemption
    shown = set(recorded) - set(RECORDED_NOT_ON_A_DASHBOARD)
    assert shown <= used, f"recorded but on no panel: {sorted(shown - used)}"
    variable = cluster["templating"]["list"][1]["query"]["query"]
    series = re.fullmatch(r"label_values\(([^,{]+)(?:\{[^}]*\})?, job_id\)", variable)
    assert series and series.group(1) in recorded, variable


def test_recorded_names_come_from_the_rules_file(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text(
        "groups:\n  - name: g\n    rules:\n"
        "      - record: job_id:x:sum\n        expr: sum by (job_id) (x)\n"
        "      - alert: A\n        expr: up == 0\n"
    )
    assert recorded_names(rules) == {"job_id:x:sum": "sum by (job_id) (x)"}

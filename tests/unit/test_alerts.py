"""Alert rules and the Prometheus deployment example, checked with promtool."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers.paths import ROOT

PROM = ROOT / "deploy" / "prometheus"
REQUIRED = {
    "ProfagentGpuIdle", "ProfagentJobHang", "ProfagentGpuMemoryLeak", "ProfagentHostMemoryLeak",
    "ProfagentGpuXidError", "ProfagentCollectorDown", "ProfagentNoTraces", "ProfagentAgentDown",
    "ProfagentFindingCritical", "ProfagentFindingWarning", "ProfagentFindingInfo",
}


def _promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is not installed: `make test` installs Debian's prometheus package")
    return subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _rules() -> list[dict]:
    """The alerting rules (the file also records the series one of them is built on)."""
    return [r for g in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_rules_pass_promtool_check() -> None:
    res = _promtool("check", "rules", "alerts.yml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_rule_unit_tests_pass() -> None:
    res = _promtool("test", "rules", "alerts_test.yml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_alert_is_unit_tested_firing_and_quiet() -> None:
    tests = yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in tests:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {r["alert"] for r in _rules()}
    assert names >= REQUIRED
    assert names <= firing, f"never shown firing: {names - firing}"
    assert quiet >= REQUIRED, f"never shown quiet: {REQUIRED - quiet}"


def test_rules_have_severity_and_text() -> None:
    for rule in _rules():
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_prometheus_config_passes_promtool_check() -> None:
    res = _promtool("check", "config", "prometheus.yml")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "WARNING" not in res.stdout + res.stderr
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert cfg["rule_files"] == ["alerts.yml", "recording.yml"]
    (job,) = cfg["scrape_configs"]
    assert job["job_name"] == "profagent"  # ProfagentAgentDown selects up{job="profagent"}
    assert job["file_sd_configs"][0]["files"]
    for target_file in (PROM / "targets").glob("*.yml"):
        for group in yaml.safe_load(target_file.read_text()):
            assert group["targets"]


def test_one_findings_rule_per_severity() -> None:
    from profagent.contracts import SEVERITIES

    by_severity = {r["labels"]["severity"]: r for r in _rules() if r["alert"].startswith("ProfagentFinding")}
    assert set(by_severity) == set(SEVERITIES)
    for severity, rule in by_severity.items():
        assert re.search(rf'profagent_finding{{severity="{severity}"[,}}]', rule["expr"]), rule["expr"]


def test_a_hang_pages_once_per_job() -> None:
    """ProfagentJobHang is the one page of a hang: per job (not per node or rank), and no
    other rule pages for the same stall or hang finding."""
    rules = {r["alert"]: r for r in _rules()}
    assert re.findall(r"by \(([^)]*)\)", rules["ProfagentJobHang"]["expr"]) == ["cluster, job_id"] * 2
    others = [r for name, r in rules.items() if name != "ProfagentJobHang"]
    assert not [r["alert"] for r in others if "profagent_rank_stalled" in r["expr"]]
    assert 'finding!="hang"' in rules["ProfagentFindingCritical"]["expr"]

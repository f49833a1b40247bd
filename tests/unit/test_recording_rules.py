"""Job-level recording rules (deploy/prometheus/recording.yml), checked and unit-tested with promtool."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from helpers.paths import ROOT

PROM = ROOT / "deploy" / "prometheus"
# level:metric:operations, the metric being one of ours, or dcgm-exporter's in the rules
# that join its series with ours (group profagent_dcgm)
NAME = re.compile(r"^[a-z_]+:profagent_[a-z0-9_]+:[a-z0-9_]+$")
DCGM_NAME = re.compile(r"^[a-z_]+:DCGM_FI_[A-Z0-9_]+:[a-z0-9_]+$")
REQUIRED = {
    "job_id:profagent_trace_step_seconds:median",
    "job_id:profagent_trace_step_seconds:max",
    "instance_job_id_rank:profagent_trace_step_seconds:ratio_to_job_median",
    "job_id:profagent_process_gpu_sm_utilization_ratio:avg",
    "job_id:profagent_gpu_utilization_ratio:avg",
    "job_id:profagent_rank_stalled:sum",
    "job_id_severity:profagent_finding:sum",
    # dcgm-exporter's GPU series in profagent's labels and units, and per job and rank
    "uuid:DCGM_FI_DEV_GPU_UTIL:ratio",
    "job_id:DCGM_FI_DEV_GPU_UTIL:avg_ratio",
    "instance_job_id_rank_uuid:DCGM_FI_DEV_GPU_UTIL:ratio",
    "job_id:profagent_collective_wait_ratio:median",
    "instance_job_id_rank:profagent_collective_wait_ratio:below_job_median",
    "instance_job_id_rank:profagent_collective_wait_ratio:job_straggler",
    "instance_job_id_rank:profagent_collective_wait_ratio:job_lowest",
    "job_id:profagent_collective_wait_ratio:median_of_others",
    "instance_job_id_rank:profagent_collective_wait_ratio:straggling",
    "instance_job_id_rank:profagent_hang_rank_info:culprit",
}


def _promtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is not installed: `make test` installs Debian's prometheus package")
    return subprocess.run([binary, *args], cwd=PROM, capture_output=True, text=True, timeout=120)


def _rules(group: str | None = None) -> list[dict]:
    groups = yaml.safe_load((PROM / "recording.yml").read_text())["groups"]
    return [r for g in groups if group in (None, g["name"]) for r in g["rules"]]


def test_recording_rules_pass_promtool_check() -> None:
    res = _promtool("check", "rules", "recording.yml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_recording_rule_unit_tests_pass() -> None:
    res = _promtool("test", "rules", "recording_test.yml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_names_follow_the_convention_and_every_rule_is_tested() -> None:
    rules = _rules()
    names = {r["record"] for r in rules}
    assert names >= REQUIRED
    assert all("alert" not in r for r in rules)
    dcgm = {r["record"] for r in _rules("profagent_dcgm")}
    for name in names:
        assert (DCGM_NAME if name in dcgm else NAME).match(name), name
    tests = yaml.safe_load((PROM / "recording_test.yml").read_text())["tests"]
    tested = " ".join(check["expr"] for case in tests for check in case.get("promql_expr_test", []))
    untested = {n for n in names if n not in tested}
    assert not untested, f"no promql_expr_test for {untested}"


def test_job_aggregations_keep_cluster_and_never_merge_nodes_per_rank() -> None:
    for rule in _rules():
        expr = rule["expr"]
        for by in re.findall(r"by \(([^)]*)\)", expr):
            labels = {x.strip() for x in by.split(",")}
            assert "cluster" in labels, (rule["record"], by)
            # Per-rank aggregations must keep instance: rank "0" exists on many nodes.
            if "rank" in labels:
                assert "instance" in labels, (rule["record"], by)


def test_prometheus_loads_the_recording_rules() -> None:
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    assert "recording.yml" in cfg["rule_files"]
    res = _promtool("check", "config", "prometheus.yml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_dcgm_joins_go_through_the_uuid_never_instance_or_gpu() -> None:
    """dcgm-exporter and profagent are two targets (instances differ) and may number GPUs
    differently in containers: every join of their series is on the GPU UUID."""
    rules = _rules("profagent_dcgm")
    assert rules
    for rule in rules:
        for on in re.findall(r"on \(([^)]*)\)", rule["expr"]):
            assert {x.strip() for x in on.split(",")} == {"cluster", "uuid"}, (rule["record"], on)
        # a raw dcgm-exporter series (not a recorded one, level:DCGM_...:op) gets `uuid` first
        if re.search(r"(?<![:\w])DCGM_FI_", rule["expr"]):
            assert 'label_replace(DCGM_FI_' in rule["expr"] and '"uuid", "$1", "UUID"' in rule["expr"], rule["record"]

"""Every dashboard panel, proven against a real Prometheus scraping a real agent.

One module-wide setup: a torch CPU training job (`examples/train.py --ranks 2`) writing
profiler traces into a watched folder and polling the agent's Kineto endpoint (a private
socket folder), `profagent attach` with stacks on and the simulated GPU backend, and a
Prometheus scraping it every second. The job is CPU-only,
so its traces have no GPU side: a real GPU trace from ../shared/traces/gpu is dropped
into the same folder as rank 9 (its distributedInfo rank rewritten), and a file that is
not a trace is dropped there too, so the rejected-files panel has something to show.

Prometheus also evaluates the job-level recording rules (deploy/prometheus/recording.yml)
every second, so the "Job across nodes" dashboard, built on the recorded series, is run
for real too, and the recorded figures are checked against the raw series.

Then every target of every committed dashboard, variables substituted, must parse and
return data through Prometheus' HTTP API.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from helpers.agent import AgentProcess, free_port, http_get, parse_metrics
from helpers.paths import ROOT, shared_traces
from helpers.processes import kill_tree, wait_for
from helpers.prometheus import Prometheus, promtool_check_metrics
from profagent_dashboards.coverage import (
    NOT_ON_A_DASHBOARD,
    ONLY_AFTER_A_FAILURE,
    RECORDING_RULES,
    recorded_names,
)
from profagent_dashboards.model import PanelQuery, iter_targets, metric_names

pytestmark = pytest.mark.slow

DASHBOARDS = ROOT / "dashboards"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
FAMILIES_SRC = ROOT / "src" / "profagent" / "exporters" / "families"
JOB_ID = "dash-e2e"
GPU_TRACE = shared_traces() / "a100-2gpu-nccl.pt.trace.json.gz"
GPU_TRACE_RANK = "9"

# Grafana's built-in variables, as Grafana would expand them for a short time range.
BUILTINS = {"$__rate_interval": "10s", "$__interval": "2s", "$__range": "2m"}

SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")

# Prometheus' own series about the scrape, present without the agent emitting them.
SCRAPE_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped", "scrape_samples_post_metric_relabeling", "scrape_series_added",
                 "ALERTS"}  # Prometheus' own: its scrapes' series and its alerts' (an alert may test another)


@dataclass
class Stack:
    prom: Prometheus
    instance: str
    agent_url: str
    agent: AgentProcess


def _gpu_trace_as_rank(dest: Path) -> None:
    """A real GPU trace, relabelled as rank 9 of this job, written the way Kineto does."""
    trace = json.loads(gzip.decompress(GPU_TRACE.read_bytes()))
    trace.setdefault("distributedInfo", {})["rank"] = int(GPU_TRACE_RANK)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_bytes(gzip.compress(json.dumps(trace).encode()))
    tmp.rename(dest)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("dashboards-e2e")
    traces = tmp / "traces"
    traces.mkdir()
    # a private Kineto endpoint, not the machine-wide @dynolog; short: a Kineto client's
    # socket there is named dynoconfigclient<uuid> (52 bytes) and a socket path has 108 at most
    sockets = Path(tempfile.mkdtemp(prefix="pa-", dir="/tmp"))
    os.chmod(sockets, 0o755)
    env = {**os.environ, "TORCHELASTIC_RUN_ID": JOB_ID, "KINETO_USE_DAEMON": "1", "KINETO_IPC_SOCKET_DIR": str(sockets)}
    job = subprocess.Popen(
        # 50 ms of sleep a step: the panels need steps, not load (the module runs minutes)
        [sys.executable, str(ROOT / "examples" / "train.py"), "--ranks", "2", "--workers", "1",
         "--trace-dir", str(traces), "--profile-every", "60", "--step-sleep", "0.05"],
        env=env, stdout=(tmp / "train.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    agent: AgentProcess | None = None
    prom: Prometheus | None = None
    try:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        agent = AgentProcess(
            ["attach", "--pid", str(job.pid), "--listen", f"127.0.0.1:{port}", "--interval", "0.5",
             "--trace-dir", str(traces), "--stacks", "--stack-dataloader", "--gpu-backend", "simulated:h100x2"],
            # a 20 s findings window: the wait-share panels fill after one window, not the default minute
            tmp, env={"PROFAGENT_STATE_DIR": str(tmp / "state"), "PROFAGENT_ONDEMAND_SOCKET_DIR": str(sockets),
                      "PROFAGENT_FINDINGS_WINDOW_SECONDS": "20",
                      "PROFAGENT_ONDEMAND_CONTROL_SOCKET": str(tmp / "control.sock"),
                      "PROFAGENT_ONDEMAND_TRACE_DIR": str(tmp / "ondemand")},
        )
        agent.wait_healthy(url, timeout=60)
        prom = Prometheus([f"127.0.0.1:{port}"], tmp, rule_files=[RECORDING_RULES, ALERTS])
        _gpu_trace_as_rank(traces / f"gpu-rank{GPU_TRACE_RANK}.pt.trace.json.gz")
        (traces / "notes.json").write_text('{"hello": "not a trace"}')
        wait_for(lambda: _everything_flows(url), timeout=120, interval=0.5,
                 what="traces of ranks 0, 1 and 9, a rejected file, stacks of both roles, GPU memory and Kineto polls per rank")
        yield Stack(prom, f"127.0.0.1:{port}", url, agent)
    finally:
        if prom is not None:
            prom.stop()
        if agent is not None:
            agent.stop()
        kill_tree(job)
        shutil.rmtree(sockets, ignore_errors=True)


# -- helpers ---------------------------------------------------------------------------


def _everything_flows(agent_url: str) -> bool:
    metrics = parse_metrics(http_get(agent_url + "/metrics"))

    def labels(name: str, key: str) -> set[str]:
        return {lab.get(key, "") for lab, _ in metrics.get(name, [])}

    return (
        {"0", "1", GPU_TRACE_RANK} <= labels("profagent_trace_step_seconds", "rank")
        and GPU_TRACE_RANK in labels("profagent_trace_gpu_idle_ratio", "rank")
        and "profagent_traces_rejected_total" in metrics
        and {"main", "dataloader"} <= labels("profagent_stack_samples_total", "role")
        and {"0", "1"} <= labels("profagent_process_gpu_memory_used_bytes", "rank")
        and {"0", "1"} <= labels("profagent_ondemand_processes", "rank")
    )


def _dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def _targets() -> list[PanelQuery]:
    return [t for model in _dashboards().values() for t in iter_targets(model)]


def _alert_exprs() -> dict[str, str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "alert" in r}  # not recording rules


def substitute(expr: str, instance: str) -> str:
    """Variables as Grafana sends them: one node and job, All ranks and GPUs."""
    values = {
        **BUILTINS,
        "$instance": re.escape(instance).replace("\\", "\\\\"),
        "$job_id": JOB_ID,
        "$rank": ".*",
        "$gpu": ".*",
    }
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(name, values[name])
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def _api(prom: Prometheus, path: str, params: dict[str, str]) -> dict:
    import urllib.error

    try:
        body = json.loads(http_get(f"{prom.url}/api/v1/{path}?{urlencode(params)}", timeout=10))
    except urllib.error.HTTPError as exc:  # 400 = the expression does not parse
        body = json.loads(exc.read().decode())
    return body


def run_target(prom: Prometheus, target: PanelQuery, instance: str) -> tuple[str, int]:
    """(error or "", number of series) for one panel target."""
    expr = substitute(target.expr, instance)
    now = time.time()
    if target.instant:
        body = _api(prom, "query", {"query": expr, "time": f"{now:.3f}"})
    else:
        body = _api(prom, "query_range", {"query": expr, "start": f"{now - 60:.3f}", "end": f"{now:.3f}", "step": "2"})
    if body.get("status") != "success":
        return f"{body.get('errorType')}: {body.get('error')}", 0
    return "", len(body["data"]["result"])


def exposition_names(text: str) -> set[str]:
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def declared_in_renderers(name: str) -> bool:
    """A counter's family is declared without `_total`, a histogram's without `_sum`,
    `_count` and `_bucket` (the client library adds them)."""
    base = re.sub(r"_(total|sum|count|bucket)$", "", name)
    source = "\n".join(p.read_text() for p in FAMILIES_SRC.glob("*.py"))
    return f'"{base}"' in source


# -- tests -----------------------------------------------------------------------------


def test_whole_exposition_passes_promtool(stack: Stack) -> None:
    """Every source on (host, simulated GPU, stacks, traces, on-demand): promtool is silent."""
    assert promtool_check_metrics(http_get(stack.agent_url + "/metrics")) == ""


def test_prometheus_scrapes_the_agent(stack: Stack) -> None:
    result = wait_for(lambda: stack.prom.query(f'profagent_trace_gpu_idle_ratio{{rank="{GPU_TRACE_RANK}"}}'),
                      timeout=30, what="Prometheus to scrape the GPU trace's figures")
    assert result[0]["metric"]["job_id"] == JOB_ID


def test_every_panel_target_returns_data(stack: Stack) -> None:
    targets = _targets()
    assert len(targets) > 60
    exposition = exposition_names(http_get(stack.agent_url + "/metrics"))
    failure_only = {name for name in ONLY_AFTER_A_FAILURE if name not in exposition and not stack.prom.query(name)}
    pending = {(t.dashboard, t.panel, t.ref_id): t for t in targets}
    problems: dict[tuple[str, str, str], str] = {}
    deadline = time.monotonic() + 90
    while pending and time.monotonic() < deadline:
        for key, target in list(pending.items()):
            error, series = run_target(stack.prom, target, stack.instance)
            if error:
                problems[key] = f"does not run: {error}"
                del pending[key]
            elif series:
                problems.pop(key, None)
                del pending[key]
            elif metric_names(target.expr) & failure_only:
                problems.pop(key, None)  # parses; empty until something fails
                del pending[key]
            else:
                problems[key] = f"no data: {substitute(target.expr, stack.instance)}"
        if pending:
            time.sleep(1)
    assert not problems, "\n".join(f"{d} / {p} / {r}: {why}" for (d, p, r), why in sorted(problems.items()))


def test_every_referenced_metric_exists(stack: Stack) -> None:
    exposition = exposition_names(http_get(stack.agent_url + "/metrics")) | SCRAPE_SERIES
    recorded = {**recorded_names(), **recorded_names(ALERTS)}  # alerts.yml records one series too
    used: dict[str, str] = {}
    for target in _targets():
        for name in metric_names(target.expr):
            used.setdefault(name, f"{target.dashboard} / {target.panel}")
    for alert, expr in _alert_exprs().items():
        for name in metric_names(expr):
            used.setdefault(name, f"alert {alert}")
    missing = {
        name: where for name, where in used.items()
        if name not in exposition and name not in recorded
        and not (name in ONLY_AFTER_A_FAILURE and declared_in_renderers(name))
    }
    assert not missing, f"referenced but not exported: {missing}"
    unrecorded = {
        name: where for name, where in used.items()
        if name in recorded and name not in ONLY_AFTER_A_FAILURE and not stack.prom.query(name)
    }
    assert not unrecorded, f"recording rules that Prometheus does not record: {unrecorded}"


def test_label_matchers_name_labels_the_metric_has(stack: Stack) -> None:
    """`rank=~".*"` also matches a series without a rank label, so the data test alone
    would not notice a matcher on a label the metric lacks: Grafana, with one rank
    picked, would then show nothing."""
    labels: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(http_get(stack.agent_url + "/metrics")):
        for sample in fam.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    target_labels = {"instance", "job"}
    wrong = []
    exprs = [(f"{t.dashboard} / {t.panel}", t.expr) for t in _targets()]
    exprs += [(f"alert {name}", expr) for name, expr in _alert_exprs().items()]
    for where, expr in exprs:
        for metric, matchers in SELECTOR.findall(expr):
            if metric not in labels:
                continue  # only-after-a-failure series, or Prometheus' own
            for label in MATCHER.findall(matchers):
                if label not in labels[metric] | target_labels:
                    wrong.append(f"{where}: {metric} has no label {label!r}")
    assert not wrong, "\n".join(wrong)


def _at(prom: Prometheus, expr: str, when: float) -> dict[str, float]:
    """rank -> value of ``expr`` evaluated at ``when``."""
    body = _api(prom, "query", {"query": expr, "time": f"{when:.3f}"})
    assert body.get("status") == "success", body
    return {r["metric"].get("rank", ""): float(r["value"][1]) for r in body["data"]["result"]}


def _scrapes_seen_at(prom: Prometheus, expr: str, when: float, label: str) -> list[dict[str, float]]:
    """``label`` -> value of the raw series ``expr`` in the last scrape at or before ``when``,
    then in the one before. A rule evaluated at ``when`` saw one of the two: the last scrape
    is stamped with its start time but stored only once read, maybe after the evaluation
    (one agent, so one scrape stamps every series alike, and Prometheus reads one at a time)."""
    body = _api(prom, "query", {"query": f"{expr}[5s]", "time": f"{when:.3f}"})
    assert body.get("status") == "success", body
    series = {r["metric"].get(label, ""): [float(v) for _, v in sorted(r["values"])] for r in body["data"]["result"]}
    return [{k: v[-back] for k, v in series.items() if len(v) >= back} for back in (1, 2)]


def test_recorded_step_figures_match_the_raw_series(stack: Stack) -> None:
    """Median, max, count and each rank's ratio to the median, recomputed here from the
    step times Prometheus held when the rules were evaluated (ranks 0 and 1 on CPU, rank 9
    from a GPU trace, so the ratios are far from 1)."""
    job = f'job_id="{JOB_ID}"'
    stamped = wait_for(lambda: stack.prom.query(f"timestamp(job_id:profagent_trace_step_seconds:count{{{job}}}) "
                                                f"and job_id:profagent_trace_step_seconds:count{{{job}}} == 3"),
                       timeout=60, what="a rule evaluation that saw the step times of ranks 0, 1 and 9")
    when = float(stamped[0]["value"][1])

    def one(name: str) -> float:
        (value,) = _at(stack.prom, f"job_id:profagent_trace_step_seconds:{name}{{{job}}}", when).values()
        return value

    # The group's rules run one after another, all stamped `when`, each reading the raw
    # series as they are then: a scrape stored between two rules is seen by the later ones
    # only (seen under stress: the ratios used a newer rank-1 step than the median). So each
    # figure matches the scrape before `when` or the last one, never older than the rule
    # before it saw.
    older_first = [s for s in reversed(_scrapes_seen_at(stack.prom, f"profagent_trace_step_seconds{{{job}}}", when, "rank")) if s]

    def seen_by(figure: str, got: object, expected: Callable[[dict[str, float]], object], after: int) -> int:
        """The index in ``older_first`` of the first scrape from ``after`` on that gives ``got``."""
        for i in range(after, len(older_first)):
            if got == pytest.approx(expected(older_first[i])):
                return i
        pytest.fail(f"{figure} {got} matches no scrape the rule could have seen at {when}: {older_first[after:]}")

    seen = seen_by("median", one("median"), lambda s: statistics.median(s.values()), 0)
    assert set(older_first[seen]) == {"0", "1", GPU_TRACE_RANK}
    seen = seen_by("max", one("max"), lambda s: max(s.values()), seen)
    assert one("count") == 3
    median = one("median")
    ratios = _at(stack.prom, f"instance_job_id_rank:profagent_trace_step_seconds:ratio_to_job_median{{{job}}}", when)
    seen_by("ratios to the median", ratios, lambda s: {rank: step / median for rank, step in s.items()}, seen)
    assert one("max_ratio_to_median") == pytest.approx(max(ratios.values()))
    assert one("max_ratio_to_median") != pytest.approx(1.0)


def test_recorded_job_wide_figures_match_the_raw_series(stack: Stack) -> None:
    """Nodes, stalled ranks and device utilisation of the job's GPUs, from the raw series."""
    job = f'job_id="{JOB_ID}"'
    stamped = wait_for(lambda: stack.prom.query(f"timestamp(job_id:profagent_gpu_utilization_ratio:avg{{{job}}})"),
                       timeout=60, what="the job-wide GPU utilisation rule")
    when = float(stamped[0]["value"][1])
    nodes = _at(stack.prom, f"job_id:profagent_target_up:nodes{{{job}}}", when)
    assert list(nodes.values()) == [1.0]  # one agent, one node
    stalled = [sum(s.values()) for s in _scrapes_seen_at(stack.prom, f"profagent_rank_stalled{{{job}}}", when, "rank")]
    (recorded_stalled,) = _at(stack.prom, f"job_id:profagent_rank_stalled:sum{{{job}}}", when).values()
    assert recorded_stalled in stalled, (recorded_stalled, stalled)
    body = _api(stack.prom, "query", {"query": f"profagent_process_gpu_memory_used_bytes{{{job}}}", "time": f"{when:.3f}"})
    job_gpus = {r["metric"]["gpu"] for r in body["data"]["result"]}
    scrapes = _scrapes_seen_at(stack.prom, "profagent_gpu_utilization_ratio", when, "gpu")
    assert job_gpus and job_gpus <= set(scrapes[0])
    (recorded,) = _at(stack.prom, f"job_id:profagent_gpu_utilization_ratio:avg{{{job}}}", when).values()
    means = [statistics.mean(util[g] for g in job_gpus) for util in scrapes if job_gpus <= set(util)]
    assert any(recorded == pytest.approx(mean) for mean in means), (recorded, means)


def test_every_exported_family_is_on_a_dashboard_or_allowlisted(stack: Stack) -> None:
    exposition = exposition_names(http_get(stack.agent_url + "/metrics"))
    on_panels = {name for t in _targets() for name in metric_names(t.expr)}
    unused = sorted(exposition - on_panels - set(NOT_ON_A_DASHBOARD))
    assert not unused, f"exported but on no panel and not in NOT_ON_A_DASHBOARD: {unused}"
    stale = sorted(set(NOT_ON_A_DASHBOARD) & on_panels)
    assert not stale, f"on a panel and in NOT_ON_A_DASHBOARD: {stale}"


def test_alert_expressions_run(stack: Stack) -> None:
    for alert, expr in _alert_exprs().items():
        body = _api(stack.prom, "query", {"query": expr})
        assert body.get("status") == "success", f"{alert}: {body}"

"""Incident bundles end to end: a real torchrun/gloo job whose rank 1 hangs before all_reduce.

The agent (real subprocess, real py-spy) must capture one `hang` incident with every
rank's stacks within stacks.stall_seconds + 40 s, list it over HTTP and the CLI, never
leave a rank stopped, and capture nothing more when the job recovers and hangs again
within incidents.rate_limit_seconds (it counts the trigger as rate-limited instead).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
from pathlib import Path

import psutil
import pytest

from helpers.agent import free_port, http_get, parse_metrics
from helpers.paths import WORKLOADS
from helpers.processes import kill_tree, pyspy_processes, wait_for

STALL_SECONDS = 4.0
TORCHRUN = Path(sys.executable).with_name("torchrun")



def api_incidents(url: str, **query: str) -> list[dict]:
    """GET /api/incidents: an object whose "incidents" is the list (docs/openapi.yaml)."""
    body = json.loads(http_get(url + "/api/incidents" + (f"?{urllib.parse.urlencode(query)}" if query else "")))
    assert isinstance(body, dict) and set(body) == {"incidents"}, body
    return body["incidents"]

def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profagent", *args], capture_output=True, text=True, timeout=120)


def metric(url: str, name: str, **labels: str) -> list[float]:
    m = parse_metrics(http_get(url + "/metrics"))
    return [v for lbl, v in m.get(name, []) if all(lbl.get(k) == want for k, want in labels.items())]


def ranks_of(launcher: psutil.Process) -> dict[str, psutil.Process]:
    out = {}
    for child in launcher.children(recursive=True):
        try:
            rank = child.environ().get("RANK")
        except psutil.Error:
            continue
        if rank is not None and "gloo_hang.py" in " ".join(child.cmdline()):
            out[rank] = child
    return out


def test_hang_captures_one_incident_with_every_rank_and_rate_limits_the_repeat(tmp_path: Path, run_agent) -> None:
    hang_file, steps_dir, inc_dir = tmp_path / "hang", tmp_path / "steps", tmp_path / "incidents"
    steps_dir.mkdir()
    job = subprocess.Popen(
        [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(WORKLOADS / "gloo_hang.py")],
        env={**os.environ, "HANG_FILE": str(hang_file), "STEPS_DIR": str(steps_dir), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "job.log").open("wb"), start_new_session=True,
    )
    try:
        ranks = wait_for(lambda: (r := ranks_of(psutil.Process(job.pid))) and len(r) == 2 and r, 60, what="2 ranks")
        wait_for(lambda: all((steps_dir / f"rank{r}.steps").exists() for r in "01"), 60, what="both ranks stepping")
        config = tmp_path / "agent.toml"
        config.write_text(
            f"state_dir = '{tmp_path / 'state'}'\n"
            f"[stacks]\nstall_seconds = {STALL_SECONDS}\nwindow = 2\nrate = 20\n"
            # A private on-demand folder: the default /tmp/profagent-ondemand may belong to another
            # user's agent (root's service), and then on-demand, with the control socket, is off.
            f"[ondemand]\nsocket_dir = '{tmp_path / 's'}'\ncontrol_socket = '{tmp_path / 'c.sock'}'\n"
            f"trace_dir = '{tmp_path / 'ondemand'}'\n"
            f"[incidents]\ndir = '{inc_dir}'\nrate_limit_seconds = 3600\n"
        )
        (tmp_path / "s").mkdir()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        agent = run_agent(["attach", "--pid", str(job.pid), "--listen", f"127.0.0.1:{port}",
                           "--config", str(config), "--gpu-backend", "off"])
        agent.wait_healthy(url, timeout=60)
        wait_for(lambda: metric(url, "profagent_incidents_total", kind="hang") == [0.0], 30, what="the incidents family")
        wait_for(lambda: len(metric(url, "profagent_rank_stalled")) == 2, 60, what="both ranks sampled")
        assert metric(url, "profagent_rank_stalled") == [0.0, 0.0]  # stepping: no stall, no incident
        assert api_incidents(url) == []

        hang_file.touch()
        hung_at = time.monotonic()

        def one_complete_incident() -> dict | None:
            items = api_incidents(url)
            return items[0] if len(items) == 1 and items[0]["status"] == "complete" else None

        incident = wait_for(one_complete_incident, STALL_SECONDS + 40, interval=0.5, what="a complete hang incident")
        assert time.monotonic() - hung_at < STALL_SECONDS + 40
        assert incident["kind"] == "hang" and incident["rank"] in ("0", "1")
        folder = Path(incident["path"])
        assert folder.parent == inc_dir and folder.name == incident["id"]
        assert (folder.stat().st_mode & 0o777) == 0o700
        for rank in "01":
            stacks = (folder / f"stacks-rank{rank}.txt").read_text()
            assert "gloo_hang.py" in stacks, stacks
            assert f"Process {ranks[rank].pid}" in stacks
        assert "wait_while_hung" in (folder / "stacks-rank1.txt").read_text()  # rank 1's own frame
        findings = json.loads((folder / "findings.json").read_text())
        assert findings["trigger"]["kind"] == "hang"
        assert {f["rank"] for f in findings["findings"] if f["finding"] == "hang"} >= {"1"}
        assert "profagent_rank_stalled" in (folder / "metrics.prom").read_text()
        summary = (folder / "summary.md").read_text()
        assert "hang" in summary and "gloo_hang.py" in summary and f"{ranks['1'].pid}" in summary
        for proc in ranks.values():  # py-spy never left a rank stopped
            assert proc.status() != psutil.STATUS_STOPPED
        # (a sampler window that just ended may be a zombie for one poll: pyspy_processes skips those)
        assert not [c for c in pyspy_processes(of=agent.proc.pid) if "dump" in _cmdline(c)], \
            "a py-spy dump child was left behind"

        listed = run_cli("incidents", "list", "--dir", str(inc_dir))
        assert listed.returncode == 0 and incident["id"] in listed.stdout, listed.stderr
        via_url = run_cli("incidents", "list", "--url", url, "--json")
        assert [i["id"] for i in json.loads(via_url.stdout)] == [incident["id"]]
        # Another job's bundle in the same folder (another agent of the user wrote it): the
        # folder lists it, this agent's API and `list --url` do not, nor show it by id.
        other = inc_dir / "20000101T000000Z-other-job-hang"
        other.mkdir(mode=0o700)
        (other / "incident.json").write_text(json.dumps({"id": other.name, "kind": "hang", "job_id": "other-job",
                                                         "time": 946684800.0, "status": "complete"}))
        assert other.name in run_cli("incidents", "list", "--dir", str(inc_dir)).stdout
        assert [i["id"] for i in json.loads(run_cli("incidents", "list", "--url", url, "--json").stdout)] == [incident["id"]]
        assert [i["id"] for i in api_incidents(url, job="other-job")] == []
        with pytest.raises(urllib.error.HTTPError) as exc:
            http_get(f"{url}/api/incidents?id={other.name}")
        assert exc.value.code == 404
        shutil.rmtree(other)
        shown = run_cli("incidents", "show", incident["id"], "--dir", str(inc_dir))
        assert shown.returncode == 0 and "Which line" in shown.stdout and "stacks-rank1.txt" in shown.stdout
        assert run_cli("incidents", "show", "nope", "--dir", str(inc_dir)).returncode == 2
        assert metric(url, "profagent_incidents_total", kind="hang") == [1.0]

        # Recover, then hang again within the rate-limit period: the agent sees the stall
        # (counted as rate-limited) but captures nothing more.
        hang_file.unlink()
        wait_for(lambda: metric(url, "profagent_rank_stalled") == [0.0, 0.0], 60, what="ranks moving again")
        hang_file.touch()
        wait_for(lambda: metric(url, "profagent_incidents_rate_limited_total", kind="hang") == [1.0],
                 STALL_SECONDS + 40, what="the second hang seen and rate-limited")
        assert len(api_incidents(url)) == 1
        assert metric(url, "profagent_incidents_total", kind="hang") == [1.0]
        hang_file.unlink()

        # A manual capture over the control socket; a second one is rate-limited (exit 2).
        captured = run_cli("incidents", "capture", "--config", str(config), "--reason", "test")
        assert captured.returncode == 0 and "captured" in captured.stdout, captured.stdout + captured.stderr
        again = run_cli("incidents", "capture", "--config", str(config))
        assert again.returncode == 2 and "rate limited" in again.stderr
        kinds = sorted(i["kind"] for i in api_incidents(url))
        assert kinds == ["hang", "manual"]
        for proc in ranks.values():
            assert proc.status() != psutil.STATUS_STOPPED
    finally:
        hang_file.unlink(missing_ok=True)
        kill_tree(job)


def test_step_time_regression_captures_an_incident_with_an_on_demand_trace(tmp_path: Path, run_agent) -> None:
    """Rank 0 profiles itself; its step time doubles; rank 1 polls Kineto and is traced."""
    slow_file, traces = tmp_path / "slow", tmp_path / "traces"
    # libkineto binds client sockets in this folder: keep the path short (108-byte limit).
    sockets = Path(tempfile.mkdtemp(prefix="pa-", dir="/tmp"))
    inc_dir = tmp_path / "incidents"
    traces.mkdir()
    job = subprocess.Popen(
        [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(WORKLOADS / "slowdown.py")],
        env={**os.environ, "SLOW_FILE": str(slow_file), "TRACE_DIR": str(traces), "OMP_NUM_THREADS": "1",
             "KINETO_USE_DAEMON": "1", "KINETO_IPC_SOCKET_DIR": str(sockets)},
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "job.log").open("wb"), start_new_session=True,
    )
    try:
        config = tmp_path / "agent.toml"
        config.write_text(
            f"state_dir = '{tmp_path / 'state'}'\n"
            f"[stacks]\nenabled = false\n"
            f"[ondemand]\nsocket_dir = '{sockets}'\ncontrol_socket = '{tmp_path / 'c.sock'}'\n"
            f"trace_dir = '{tmp_path / 'ondemand'}'\n"
            f"[incidents]\ndir = '{inc_dir}'\nregression_factor = 1.5\nregression_seconds = 1\n"
        )
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        agent = run_agent(["attach", "--pid", str(job.pid), "--listen", f"127.0.0.1:{port}", "--trace-dir", str(traces),
                           "--config", str(config), "--gpu-backend", "off"])
        agent.wait_healthy(url, timeout=60)

        def polling_ranks() -> list[str]:
            return sorted(lbl["rank"] for lbl, v in parse_metrics(http_get(url + "/metrics")).get(
                "profagent_ondemand_processes", []) if v >= 1 and lbl["role"] == "main")

        wait_for(lambda: polling_ranks() == ["1"], 90, interval=0.5, what="rank 1 polling Kineto")
        ingested: list[float] = []

        def three_traces() -> bool:
            ingested[:] = metric(url, "profagent_traces_total", status="ingested")
            return bool(ingested) and ingested[0] >= 3

        wait_for(three_traces, 120, interval=0.5, what="three baseline traces of rank 0")
        baseline = metric(url, "profagent_trace_step_seconds", rank="0")[0]
        assert api_incidents(url) == []  # a steady job has no incident
        slow_file.touch()

        def regression_incident() -> dict | None:
            items = [i for i in api_incidents(url) if i["kind"] == "regression"]
            return items[0] if items and items[0]["status"] == "complete" else None

        incident = wait_for(regression_incident, 180, interval=1.0, what="a complete regression incident")
        assert incident["rank"] == "0"
        folder = Path(incident["path"])
        slow = metric(url, "profagent_trace_step_seconds", rank="0")[0]
        assert slow > 1.5 * baseline, (baseline, slow)
        findings = json.loads((folder / "findings.json").read_text())
        assert findings["trigger"]["kind"] == "regression"
        assert 0.5 * baseline < findings["trigger"]["evidence"]["baseline_seconds"] < 1.5 * baseline
        analysis = json.loads((folder / "trace-analysis-rank0.json").read_text())
        assert analysis["step_mean"] > 0
        with gzip.open(folder / "trace-rank1.pt.trace.json.gz") as fh:  # the on-demand trace, copied
            trace = json.load(fh)
        assert trace.get("traceEvents")
        assert any(p.name.endswith(".json") for p in (tmp_path / "ondemand").iterdir())  # the original stays
        summary = (folder / "summary.md").read_text()
        assert "step time regressed" in summary and "rank 0" in summary
        assert "no on-demand trace of rank 0: not polling Kineto" in summary  # rank 0 does not poll: said, not hidden
    finally:
        slow_file.unlink(missing_ok=True)
        kill_tree(job)
        shutil.rmtree(sockets, ignore_errors=True)


def test_manual_capture_works_with_on_demand_tracing_off(tmp_path: Path, run_agent, children) -> None:
    """The control socket no longer depends on the on-demand source: `incidents capture`
    works with it off, and `profagent trace` says in one line why it cannot."""
    job = children.python("import time\nwhile True:\n    time.sleep(0.05)\n")
    inc_dir, sock = tmp_path / "incidents", tmp_path / "c.sock"
    config = tmp_path / "agent.toml"
    config.write_text(
        f"state_dir = '{tmp_path / 'state'}'\n"
        f"[stacks]\nwindow = 1\n"
        f"[ondemand]\nenabled = false\ncontrol_socket = '{sock}'\n"
        f"[incidents]\ndir = '{inc_dir}'\ncapture_timeout = 20\n"
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent = run_agent(["attach", "--pid", str(job.pid), "--listen", f"127.0.0.1:{port}",
                       "--config", str(config), "--gpu-backend", "off"])
    agent.wait_healthy(url, timeout=60)
    assert sock.is_socket()

    res = run_cli("incidents", "capture", "--config", str(config), "--reason", "by hand", "--wait", "60")
    assert res.returncode == 0, res.stderr
    m = re.search(r"^incident (\S+-manual): (\S+)$", res.stdout, re.M)
    assert m and "captured" in res.stdout, res.stdout
    folder = Path(m.group(2))
    assert folder.parent == inc_dir
    assert f"Process {job.pid}" in next(folder.glob("stacks-rank*.txt")).read_text()
    summary = (folder / "summary.md").read_text()
    assert "by hand" in summary
    assert not list(folder.glob("trace-rank*"))  # nothing on demand: it is off

    res = run_cli("trace", "--pid", str(job.pid), "--config", str(config))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0, res.stderr
    assert f"on-demand tracing is off in the profagent agent PID {agent.proc.pid} (ondemand.enabled = false)" in res.stderr


def _cmdline(proc: psutil.Process) -> list[str]:
    """A child's command line, or [] if it exited meanwhile."""
    try:
        return proc.cmdline()
    except psutil.Error:
        return []

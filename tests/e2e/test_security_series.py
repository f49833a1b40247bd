"""Issue 41 item 5: rank churn. A job of ``nobody``'s that starts 50 short-lived ranks a
second, each with a RANK of its own, once grew /metrics to 38,058 series in 230 s, still
growing: the per-rank series of exited ranks lived as long as the job.

Here nobody's launcher starts a rank (``sleep 0.4`` with RANK=i) every 50 ms and says how
many it started; root's healthy job has two ranks that live throughout. A root
``profagent watch`` runs with ``watch.rank_expiry_seconds = 2`` and
``agent.max_series_per_job = 150``. Bounds held: the churning job's host series never pass
the cap, an exited rank's series are gone within the expiry plus two scrapes, what the cap
left out is counted in ``profagent_series_dropped``, and the healthy job keeps every series
of both its ranks, with nothing dropped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from helpers.agent import AgentProcess, free_port, http_get, parse_metrics, wait_for_ticks
from helpers.nobody import nobody_python
from helpers.processes import kill_tree, wait_for
from helpers.watch import token

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                       reason="plays a root agent against nobody: needs root and setpriv"),
]

CAP = 150
EXPIRY = 2.0
CHURN = textwrap.dedent("""
    import itertools, subprocess, time
    live = []
    for i in itertools.count():
        live.append(subprocess.Popen(["/bin/sleep", "0.4"], env={"RANK": str(i), "WORLD_SIZE": "100000"}))
        live = [p for p in live if p.poll() is None]
        time.sleep(0.05)
""")
HEALTHY = textwrap.dedent("""
    import subprocess, time
    ranks = [subprocess.Popen(["/bin/sleep", "3600"], env={"RANK": str(r), "WORLD_SIZE": "2"}) for r in (0, 1)]
    time.sleep(3600)
""")
HOST_FAMILIES = ("profagent_process_",)


@pytest.fixture
def folder() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="pa-churn-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _host_series(parsed: dict, job_id: str) -> list[dict[str, str]]:
    return [lab for name, rows in parsed.items() if name.startswith(HOST_FAMILIES)
            for lab, _ in rows if lab.get("job_id") == job_id]


def _keys(parsed: dict, job_id: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """The job's host series, as (family, labels)."""
    return {(name, tuple(sorted(lab.items()))) for name, rows in parsed.items() if name.startswith(HOST_FAMILIES)
            for lab, _ in rows if lab.get("job_id") == job_id}


def test_a_job_churning_ranks_keeps_metrics_bounded_and_a_healthy_job_keeps_its_series(tmp_path: Path, folder: Path) -> None:
    tok = token()
    config = tmp_path / "agent.toml"
    config.write_text(textwrap.dedent(f"""\
        interval = 0.3
        state_dir = '{tmp_path / "state"}'
        max_series_per_job = {CAP}
        [gpu]
        backend = "off"
        [stacks]
        enabled = false
        [timeline]
        enabled = false
        [ondemand]
        enabled = false
        [incidents]
        enabled = false
        [watch]
        cmdline_regex = ""
        env_markers = ["PAW_TOKEN={tok}"]
        gpu_processes = false
        scan_interval = 0.3
        rank_expiry_seconds = {EXPIRY}
        """))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent = AgentProcess(["watch", "--listen", f"127.0.0.1:{port}", "--config", str(config)], tmp_path)
    healthy = subprocess.Popen([sys.executable, "-c", HEALTHY], env={"PATH": "/usr/bin:/bin", "PAW_TOKEN": tok,
                               "SLURM_JOB_ID": "healthy"}, start_new_session=True)
    churn = None
    try:
        agent.wait_healthy(url, timeout=60)
        wait_for(lambda: {lab.get("rank") for lab in _host_series(parse_metrics(http_get(url + "/metrics")), "healthy")}
                 >= {"0", "1"}, 60, what="the healthy job's two ranks")
        wait_for_ticks(url, "host", 2)
        healthy_series = _keys(parse_metrics(http_get(url + "/metrics")), "healthy")
        churn = nobody_python(CHURN, {"PAW_TOKEN": tok, "SLURM_JOB_ID": "churn"}, folder)
        cpu_before = psutil.Process(agent.proc.pid).cpu_times()
        started = time.monotonic()
        peak, dropped, ranks_seen = 0, 0.0, set()
        while time.monotonic() - started < 8:
            parsed = parse_metrics(http_get(url + "/metrics"))
            mine = _host_series(parsed, "churn")
            peak = max(peak, len(mine))
            ranks_seen |= {lab["rank"] for lab in mine if lab.get("rank")}
            dropped = max([dropped] + [v for lab, v in parsed.get("profagent_series_dropped", []) if lab["job_id"] == "churn"])
            assert not [lab for lab, _ in parsed.get("profagent_series_dropped", []) if lab["job_id"] == "healthy"]
            missing = healthy_series - _keys(parsed, "healthy")
            assert not missing, missing  # both ranks, every series, throughout
            time.sleep(0.5)
        cpu = sum(psutil.Process(agent.proc.pid).cpu_times()[:2]) - sum(cpu_before[:2])
        elapsed = time.monotonic() - started

        # the churning job: seen, capped, and what the cap left out counted
        assert len(ranks_seen) > 20, ranks_seen
        assert peak <= CAP, peak
        assert dropped > 0

        # expiry: stop the churn; within EXPIRY and a few ticks its exited ranks' series are gone
        kill_tree(churn)
        wait_for(lambda: not [lab for lab in _host_series(parse_metrics(http_get(url + "/metrics")), "churn")
                              if lab.get("rank")], EXPIRY + 10, interval=0.3, what="the exited ranks' series gone")
        parsed = parse_metrics(http_get(url + "/metrics"))
        assert not healthy_series - _keys(parsed, "healthy")
        # about 160 ranks started and left; the agent's cost stays a fraction of a core
        assert cpu / elapsed < 0.6, (cpu, elapsed)
    finally:
        if churn is not None:
            kill_tree(churn)
        kill_tree(healthy)
        agent.stop()

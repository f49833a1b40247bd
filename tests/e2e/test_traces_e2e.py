"""End to end: `profagent attach --pid N --trace-dir DIR` while the job writes traces."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.agent import free_port, http_get, parse_metrics
from helpers.paths import WORKLOADS, shared_traces
from helpers.processes import wait_for
from helpers.prometheus import promtool_check_metrics
from helpers.traces import Reference


def _metric(text: str, name: str, **labels: str) -> list[float]:
    return [v for lab, v in parse_metrics(text).get(name, []) if all(lab.get(k) == w for k, w in labels.items())]


@pytest.mark.slow
def test_attach_with_trace_dir(tmp_path: Path, run_agent) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    job = subprocess.Popen(
        [sys.executable, str(WORKLOADS / "torch_profiled.py"), str(traces), "--gzip", "--delay", "4", "--linger", "60"],
        env={**os.environ, "SLURM_JOB_ID": "trace-e2e"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        agent = run_agent(
            ["attach", "--pid", str(job.pid), "--listen", f"127.0.0.1:{port}", "--trace-dir", str(traces),
             "--no-stacks", "--interval", "0.5"],
            env={"PROFAGENT_STATE_DIR": str(tmp_path / "state"), "PROFAGENT_GPU_BACKEND": "off"},
        )
        agent.wait_healthy(base)
        # the job's own trace (streamed .json.gz), attributed to its rank through its pid
        text = wait_for(lambda: (t := http_get(base + "/metrics")) and _metric(t, "profagent_trace_step_seconds") and t,
                        40, what="trace metrics from the job")
        assert _metric(text, "profagent_trace_steps", job_id="trace-e2e", rank="0") == [3.0]
        assert _metric(text, "profagent_traces_total", status="ingested") == [1.0]
        # The share of ATen ops in the step time depends on the machine's load (a rank
        # preempted between two ops spends that time in "other"), so it is checked against
        # an independent reading of the job's own trace file, not a fixed threshold.
        (job_trace,) = traces.glob("*.pt.trace.json.gz")
        expected = Reference(job_trace).breakdown()
        assert expected["cpu_exec"] > 0
        for category in ("cpu_exec", "dataloader", "other"):
            got = _metric(text, "profagent_trace_step_breakdown_ratio", rank="0", category=category)
            assert got == [pytest.approx(expected[category], abs=1e-6)], category
        assert not _metric(text, "profagent_trace_gpu_idle_ratio")  # CPU-only: absent, not 0

        # A GPU trace dropped in by hand (atomic rename) is picked up on its own. Not timed
        # against the ~2 s budget (settle 0.5 s + parse): under load it took 6.9 s, so a
        # wall-clock bound here fails for load alone; the deadline only catches a file
        # never picked up (or picked up by something as slow as a restart).
        tmp = traces / "rank1.pt.trace.json.gz.part.tmp"
        shutil.copy(shared_traces() / "v100-rank0.pt.trace.json.gz", tmp)
        os.replace(tmp, traces / "gpu.pt.trace.json.gz")
        text = wait_for(lambda: (t := http_get(base + "/metrics")) and _metric(t, "profagent_trace_gpu_idle_ratio") and t,
                        60, interval=0.05, what="GPU trace metrics")
        assert _metric(text, "profagent_traces_total", status="ingested") == [2.0]
        assert promtool_check_metrics(text) == ""
        assert agent.proc.poll() is None
    finally:
        job.kill()
        job.wait(10)

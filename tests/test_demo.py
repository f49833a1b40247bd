"""`make demo` keeps working and shows every landed capability."""

from __future__ import annotations

import re
import subprocess
import sys

import psutil
import pytest

from conftest import ROOT


@pytest.mark.slow
def test_demo_shows_every_capability_and_cleans_up() -> None:
    before = {p.pid for p in psutil.process_iter()}
    res = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--seconds", "30", "--every", "10", "--lines", "1"],
        capture_output=True, text=True, timeout=120,
    )
    out = res.stdout
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert "/metrics" in out
    for family in (
        "profagent_target_up",
        "profagent_process_cpu_seconds_total",
        "profagent_gpu_utilization_ratio",   # simulated GPU on this machine
        "profagent_stack_samples_total",     # py-spy
        "profagent_traces_total",            # the watched folder
        "profagent_trace_step_seconds",
        "profagent_ondemand_processes",
    ):
        assert family in out, f"{family} missing from the demo output"
    assert 'simulated="true"' in out or "simulated" in res.stderr
    # Everything the demo started is gone: the job, its ranks and workers, the agent (their
    # command lines name the demo's private folder), and py-spy (children of the agent).
    work = re.search(r"(/\S*profagent-demo-[^/\s]+)", out).group(1)
    leftovers = [p for p in psutil.process_iter(["pid", "ppid", "cmdline"])
                 if p.pid not in before and (work in " ".join(p.info["cmdline"] or [])
                                             or ("py-spy" in " ".join(p.info["cmdline"] or []) and p.info["ppid"] == 1))]
    assert not leftovers, leftovers

"""End to end: the real `profagent attach` against a real process, with and without GPUs."""

from __future__ import annotations

import socket

import pytest

from helpers.agent import free_port, http_get, parse_metrics
from helpers.processes import wait_for
from helpers.prometheus import promtool_check_metrics

pytestmark = pytest.mark.slow

# Keep the other engineers' sources quiet here: these tests are about the gpu source.
ENV = {"PROFAGENT_STACKS_ENABLED": "false"}
RANK_CHILD = "import time\ntime.sleep(120)\n"


def labels_of(metrics: dict, name: str) -> list[dict[str, str]]:
    return [lab for lab, _ in metrics.get(name, [])]


def value(metrics: dict, name: str, **want: str) -> float:
    found = [v for lab, v in metrics.get(name, []) if all(lab.get(k) == x for k, x in want.items())]
    assert len(found) == 1, (name, want, metrics.get(name))
    return found[0]


def test_attach_simulated_h100x2_shows_gpu_picture(children, run_agent, prometheus) -> None:
    kid = children.python(RANK_CHILD, env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent = run_agent(
        ["attach", "--pid", str(kid.pid), "--listen", f"127.0.0.1:{port}", "--interval", "0.2",
         "--gpu-backend", "simulated:h100x2"],
        env=ENV,
    )
    agent.wait_healthy(url)

    def ready() -> dict | None:
        m = parse_metrics(http_get(url + "/metrics"))
        return m if labels_of(m, "profagent_process_gpu_sm_utilization_ratio") else None

    m = wait_for(ready, timeout=20, what="per-process GPU metrics")
    assert value(m, "profagent_collector_up", collector="gpu") == 1
    assert value(m, "profagent_collector_up", collector="host") == 1
    infos = labels_of(m, "profagent_gpu_info")
    assert [i["gpu"] for i in sorted(infos, key=lambda i: i["gpu"])] == ["0", "1"]
    assert all(i["simulated"] == "true" and i["name"] == "NVIDIA H100 80GB HBM3" for i in infos)
    for family in ("profagent_gpu_up", "profagent_gpu_utilization_ratio", "profagent_gpu_memory_used_bytes",
                   "profagent_gpu_power_usage_watts", "profagent_gpu_energy_joules_total",
                   "profagent_gpu_temperature_celsius", "profagent_gpu_clock_hertz",
                   "profagent_gpu_pcie_throughput_bytes_per_second", "profagent_gpu_nvlink_data_bytes_total"):
        assert len({lab["gpu"] for lab in labels_of(m, family)}) == 2, family
    job = f"{socket.gethostname()}:{kid.pid}"  # nothing names the job: HOST:PID
    assert value(m, "profagent_process_gpu_memory_used_bytes", job_id=job, rank="0", role="main", gpu="0") > 0
    assert 0 < value(m, "profagent_process_gpu_sm_utilization_ratio", rank="0", gpu="0") <= 1
    assert "profagent_gpu_fan_speed_ratio" not in m  # SXM: absent, not 0
    assert promtool_check_metrics(http_get(url + "/metrics")) == ""
    assert "SIMULATED" in agent.output  # the banner says so

    # A real Prometheus scrapes it and can join per-rank GPU memory onto the GPU's info.
    prom = prometheus([f"127.0.0.1:{port}"])
    expr = ('profagent_process_gpu_memory_used_bytes{rank="0"} '
            '* on (gpu, uuid) group_left(name) profagent_gpu_info{simulated="true"}')
    result = wait_for(lambda: prom.query(expr), timeout=30, what="Prometheus query")
    assert result[0]["metric"]["name"] == "NVIDIA H100 80GB HBM3" and float(result[0]["value"][1]) > 0
    assert agent.stop() == 0


def test_attach_without_driver_turns_gpu_off_in_one_line(children, run_agent) -> None:
    kid = children.python(RANK_CHILD, env={"RANK": "0"})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent = run_agent(["attach", "--pid", str(kid.pid), "--listen", f"127.0.0.1:{port}", "--interval", "0.2"], env=ENV)
    agent.wait_healthy(url)

    def ready() -> dict | None:
        m = parse_metrics(http_get(url + "/metrics"))
        return m if labels_of(m, "profagent_process_cpu_seconds_total") else None

    m = wait_for(ready, timeout=20, what="host metrics")
    if value(m, "profagent_collector_up", collector="gpu") == 1:  # pragma: no cover
        pytest.skip("this machine has an NVIDIA driver")
    assert value(m, "profagent_collector_up", collector="host") == 1
    assert not labels_of(m, "profagent_gpu_info")
    wait_for(lambda: "metrics:" in agent.output, timeout=10, what="banner")
    lines = [ln for ln in agent.output.splitlines() if ln.strip().startswith("source gpu:")]
    assert len(lines) == 1
    assert "off: no NVIDIA driver found (libnvidia-ml.so.1): GPU metrics off" in lines[0]
    assert "Traceback" not in agent.output
    assert agent.stop() == 0


def test_bad_gpu_backend_is_one_line_exit_2(run_agent, children) -> None:
    kid = children.python(RANK_CHILD)
    agent = run_agent(["attach", "--pid", str(kid.pid), "--gpu-backend", "simulated:v100"], env=ENV)
    assert agent.proc.wait(timeout=30) == 2
    out = agent.output.strip()
    assert "invalid GPU backend 'simulated:v100'" in out and "Traceback" not in out
    assert "simulated:PROFILExN (PROFILE a100, h100 or h100-mig" in out  # the fix survives rich markup
    assert len(out.splitlines()) == 1

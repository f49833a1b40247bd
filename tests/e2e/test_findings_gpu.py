"""GPU findings (gpu_idle, gpu_throttled, gpu_errors) from a real agent, on two backends.

- ``simulated``: profagent's scripted backend (``--gpu-backend simulated:FILE.yaml``);
- ``mock``: NVIDIA's mock ``libnvidia-ml.so.1`` (../shared/nvml-mock) under the real pynvml.

Both read the same NVIDIA mock configuration (the H100 profile, three GPUs) with the real
PIDs of a real 2-rank job in the process lists, and the same ``overrides.yaml`` to change
the GPUs while the agent runs. Rank 0 iterates a real torch DataLoader on an idle GPU, so
``gpu_idle`` must say what its CPU does meanwhile (the DataLoader).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from helpers.agent import free_port, http_get, parse_metrics
from helpers.paths import WORKLOADS, nvml_mock_dir
from helpers.processes import wait_for

MOCK_DIR = nvml_mock_dir()  # NVML_MOCK_DIR, else shared/nvml-mock (helpers.paths)
PROFILE = MOCK_DIR / "configs" / "mock-nvml-config-h100.yaml"
ERRORS_SECONDS = 8

pytestmark = [pytest.mark.slow]

# A launcher with two ranks. Rank 0 iterates a DataLoader whose __getitem__ computes (the
# CPU is busy in torch/utils/data); rank 1 sleeps. Both are bounded by lifeline.
LAUNCHER = f"""
import os, subprocess, sys
sys.path.insert(0, {str(WORKLOADS)!r})
from lifeline import bound
bound(600)
RANK = '''
import os, sys, time
sys.path.insert(0, {str(WORKLOADS)!r})
from lifeline import bound
bound(600)
if os.environ["RANK"] == "0":
    import torch

    class Decode(torch.utils.data.Dataset):
        def __len__(self):
            return 1 << 30

        def __getitem__(self, i):
            return sum(k * k for k in range(4000))

    for _ in torch.utils.data.DataLoader(Decode(), batch_size=8):
        time.sleep(0.002)
else:
    while True:
        time.sleep(0.5)
'''
kids = [subprocess.Popen([sys.executable, "-c", RANK],
                         env={{**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"}})
        for r in range(2)]
with open(sys.argv[0] + ".pids.tmp", "w") as fh:
    fh.write(" ".join(str(k.pid) for k in kids))
os.rename(sys.argv[0] + ".pids.tmp", sys.argv[0] + ".pids")
for k in kids:
    k.wait()
"""


@pytest.fixture(params=["simulated", "mock"])
def backend(request) -> str:
    return request.param


class GpuJob:
    """Three configured GPUs, the 2-rank job on GPUs 0 and 1, and the agent attached to it."""

    def __init__(self, backend: str, tmp: Path, children, run_agent) -> None:
        launcher = children.python(LAUNCHER)
        pids_file = tmp / f"child_{len(children.procs) - 1}.py.pids"
        wait_for(pids_file.exists, 30, what="ranks started")
        self.pids = [int(x) for x in pids_file.read_text().split()]
        folder = tmp / "gpu"
        folder.mkdir()
        self.overrides_path = folder / "overrides.yaml"
        config = yaml.safe_load(PROFILE.read_text())
        config["devices"] = config["devices"][:3]
        # Rank 0 holds GPU 0 and does nothing on it (no utilisation sample, like a real idle
        # process); rank 1 keeps GPU 1 busy; GPU 2 holds no rank.
        config["devices"][0]["processes"] = [{"pid": self.pids[0], "type": "C", "name": "python",
                                              "used_memory_mib": 2048, "sm_util": 0, "mem_util": 0}]
        config["devices"][0]["utilization"] = {"gpu": 0, "memory": 0}
        config["devices"][1]["processes"] = [{"pid": self.pids[1], "type": "C", "name": "python",
                                              "used_memory_mib": 4096, "sm_util": 55, "mem_util": 20}]
        config["devices"][1]["utilization"] = {"gpu": 55, "memory": 20}
        config_path = folder / "config.yaml"
        config_path.write_text(yaml.safe_dump(config))

        agent_config = tmp / "profagent.toml"
        # No stall: the sleeping rank 1 must not make a hang (a hang suppresses gpu_idle).
        agent_config.write_text(
            "[stacks]\nstall_seconds = 3600\nwindow = 2\nrate = 20\n"
            f"[findings]\ngpu_idle_seconds = 2\ngpu_errors_seconds = {ERRORS_SECONDS}\nwindow_seconds = 10\n"
            "[ondemand]\nenabled = false\n")
        env = {"MOCK_NVML_OVERRIDES_TTL": "200ms"}
        if backend == "mock":
            env |= {"LD_LIBRARY_PATH": f"{MOCK_DIR}:{os.environ.get('LD_LIBRARY_PATH', '')}".rstrip(":"),
                    "MOCK_NVML_CONFIG": str(config_path)}
            gpu_backend = "nvml"
        else:
            gpu_backend = f"simulated:{config_path}"
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.agent = run_agent(["attach", "--pid", str(launcher.pid), "--listen", f"127.0.0.1:{port}",
                                "--config", str(agent_config), "--interval", "0.5", "--gpu-backend", gpu_backend],
                               env=env)
        self.agent.wait_healthy(self.url, timeout=60)

    def override(self, devices: dict | None) -> None:
        """Write (or with None delete) overrides.yaml atomically."""
        if devices is None:
            self.overrides_path.unlink(missing_ok=True)
            return
        tmp = self.overrides_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump({"version": 1, "devices": devices}))
        tmp.replace(self.overrides_path)

    def findings(self) -> list[dict]:
        return json.loads(http_get(self.url + "/api/findings"))["findings"]

    def wait(self, predicate, what: str, timeout: float = 60) -> list[dict]:
        seen: list[list[dict]] = [[]]

        def check() -> list[dict] | None:
            found = seen[0] = self.findings()
            return found if predicate(found) else None
        try:
            return wait_for(check, timeout, interval=0.5, what=what)
        except BaseException:  # say what the agent did find
            print("findings at the deadline:", json.dumps(seen[0], indent=1)[:4000])
            raise

    def active_metric(self) -> set[tuple[str, str, str]]:
        samples = parse_metrics(http_get(self.url + "/metrics")).get("profagent_finding", [])
        return {(lab["finding"], lab["rank"], lab["severity"]) for lab, v in samples if v == 1}


def of(found: list[dict], kind: str, rank: str | None = "any") -> list[dict]:
    return [f for f in found if f["finding"] == kind and (rank == "any" or f["rank"] == rank)]


def test_idle_throttled_and_failing_gpus_are_findings_of_the_ranks_using_them(
        backend, tmp_path, children, run_agent) -> None:
    job = GpuJob(backend, tmp_path, children, run_agent)

    # gpu_idle: rank 0's GPU is unused while its CPU works in the DataLoader, in the loop
    # around it, or sleeps its 2 ms a batch: the three things rank 0 does, nearly even, so
    # which one leads depends on the machine's load (the sleep led beside stress-ng, 50% to
    # the DataLoader's 49%); rank 1's is busy.
    found = job.wait(lambda fs: [f for f in of(fs, "gpu_idle", "0")
                                 if f["evidence"]["cpu_category"] in ("dataloader", "other", "idle")],
                     "gpu_idle of rank 0 saying what its CPU does", timeout=90)
    idle = of(found, "gpu_idle", "0")[0]
    assert idle["severity"] == "warning" and idle["evidence"]["gpu"] == 0
    assert idle["evidence"]["utilization"] == 0 and idle["evidence"]["cpu_share"] > 0
    assert "GPU 0 of rank 0" in idle["summary"] and idle["evidence"]["cpu_category"] in idle["summary"], idle["summary"]
    assert not of(found, "gpu_idle", "1")
    assert not of(found, "gpu_throttled") and not of(found, "gpu_errors")  # the profile starts healthy
    assert ("gpu_idle", "0", "warning") in job.active_metric()

    # gpu_throttled: thermal slowdown on rank 1's GPU (warning), power cap on GPU 2 that holds
    # no rank (info, for the job as a whole).
    job.override({"1": {"clocks_throttle_reasons": {"hw_thermal_slowdown": True}},
                  "2": {"clocks_throttle_reasons": {"sw_power_cap": True}}})
    found = job.wait(lambda fs: of(fs, "gpu_throttled", "1") and of(fs, "gpu_throttled", None), "gpu_throttled")
    thermal, power = of(found, "gpu_throttled", "1")[0], of(found, "gpu_throttled", None)[0]
    assert thermal["severity"] == "warning" and thermal["evidence"]["reasons"] == ["hw_thermal_slowdown"]
    assert thermal["evidence"]["gpu"] == 1 and "GPU 1" in thermal["summary"] and "cooling" in thermal["summary"]
    assert power["severity"] == "info" and power["evidence"] == {**power["evidence"], "gpu": 2,
                                                                 "reasons": ["sw_power_cap"]}
    assert not of(found, "gpu_throttled", "0")

    # gpu_errors: an uncorrectable ECC error with XID 48 on rank 0's GPU.
    job.override({"1": {"clocks_throttle_reasons": {"hw_thermal_slowdown": True}},
                  "2": {"clocks_throttle_reasons": {"sw_power_cap": True}},
                  "0": {"failure": {"mode": "ecc_uncorrectable", "after_calls": 1, "xid": {"code": 48}}}})
    # (the ECC counters may show before the XID event is read: wait for both)
    found = job.wait(lambda fs: [f for f in of(fs, "gpu_errors", "0") if "xid 48" in f["evidence"]["errors"]],
                     "gpu_errors of rank 0 with XID 48")
    errors = of(found, "gpu_errors", "0")[0]
    assert errors["severity"] == "critical" and errors["evidence"]["gpu"] == 0
    assert errors["evidence"]["errors"]["xid 48"] == 1, errors["evidence"]
    assert errors["evidence"]["errors"]["ecc_uncorrected"] > 0, errors["evidence"]
    assert "XID" in errors["summary"] and "GPU 0" in errors["summary"]
    assert not of(found, "gpu_errors", "1")
    assert {("gpu_errors", "0", "critical"), ("gpu_throttled", "1", "warning")} <= job.active_metric()

    # The evidence goes away: clocks released at once, the error after gpu_errors_seconds.
    job.override(None)
    found = job.wait(lambda fs: not of(fs, "gpu_throttled"), "gpu_throttled cleared")
    found = job.wait(lambda fs: not of(fs, "gpu_errors"), "gpu_errors cleared", timeout=ERRORS_SECONDS + 60)
    assert not {k for k in job.active_metric() if k[0] in ("gpu_errors", "gpu_throttled")}
    assert job.agent.stop() == 0

"""The nvidia-ml-py range pyproject.toml allows, tested at both ends against NVIDIA's mock
NVML: the lowest allowed release and the highest the range admits are installed from PyPI
into throwaway ``--target`` folders (put first on PYTHONPATH, so they shadow the venv's
pynvml), then ``profagent doctor`` and a short ``profagent attach`` run with each."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from helpers.agent import free_port, http_get, parse_metrics
from helpers.paths import ROOT, nvml_mock_dir
from helpers.processes import wait_for

MOCK_DIR = nvml_mock_dir()  # NVML_MOCK_DIR, else shared/nvml-mock (helpers.paths)
PROFILE = MOCK_DIR / "configs" / "mock-nvml-config-h100.yaml"

pytestmark = [pytest.mark.slow]


def allowed_range() -> tuple[str, str]:
    """(lowest allowed version, the whole specifier) from pyproject.toml."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [spec] = [d for d in deps if re.match(r"nvidia-ml-py\b", d)]
    floor = re.search(r">=\s*([0-9][0-9.]*)", spec)
    assert floor, f"nvidia-ml-py needs a floor in pyproject.toml: {spec}"
    return floor.group(1), spec.replace(" ", "")


@pytest.fixture(scope="module", params=["lowest", "highest"])
def pynvml_dir(request, tmp_path_factory) -> Path:
    floor, spec = allowed_range()
    requirement = f"nvidia-ml-py=={floor}" if request.param == "lowest" else spec
    target = tmp_path_factory.mktemp(f"nvml-{request.param}")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
         "--target", str(target), requirement],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, f"pip install {requirement} failed (PyPI reachable?):\n{done.stderr[-2000:]}"
    return target


def _env(pynvml_dir: Path, config: Path) -> dict[str, str]:
    return {
        "PYTHONPATH": os.pathsep.join([str(pynvml_dir), str(ROOT / "src")]),
        "LD_LIBRARY_PATH": str(MOCK_DIR),
        "MOCK_NVML_CONFIG": str(config),
        "PROFAGENT_STACKS_ENABLED": "false",
        "PROFAGENT_ONDEMAND_ENABLED": "false",
    }


def _config(tmp_path: Path, pid: int) -> Path:
    config = yaml.safe_load(PROFILE.read_text())
    config["devices"] = config["devices"][:2]
    config["devices"][0]["processes"] = [
        {"pid": pid, "type": "C", "name": "python", "used_memory_mib": 1024, "sm_util": 40, "mem_util": 10}
    ]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_doctor_and_attach_work_with_this_nvidia_ml_py(pynvml_dir, tmp_path, children, run_agent) -> None:
    kid = children.python("import time\ntime.sleep(120)\n", env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    env = _env(pynvml_dir, _config(tmp_path, kid.pid))
    which = subprocess.run([sys.executable, "-c", "import pynvml; print(pynvml.__file__)"],
                           env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert which.stdout.strip().startswith(str(pynvml_dir)), which  # the version under test, not the venv's

    doctor = subprocess.run([sys.executable, "-m", "profagent", "doctor", "--gpu-backend", "nvml"],
                            env={**os.environ, **env, "COLUMNS": "200"}, capture_output=True, text=True, timeout=120)
    out = doctor.stdout + doctor.stderr
    assert "Traceback" not in out and "AttributeError" not in out, out
    assert re.search(r"gpu\s+│ devices\s+│ ok\s+│ 2 GPU\(s\)", out), out
    assert re.search(r"gpu\s+│ GPU 0\s+│ ok\s+│ NVIDIA H100 80GB HBM3", out), out

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent = run_agent(["attach", "--pid", str(kid.pid), "--listen", f"127.0.0.1:{port}", "--interval", "0.5",
                       "--gpu-backend", "nvml"], env=env)
    agent.wait_healthy(url)

    def attributed() -> dict | None:
        m = parse_metrics(http_get(url + "/metrics"))
        return m if m.get("profagent_process_gpu_sm_utilization_ratio") else None

    m = wait_for(attributed, 30, what="per-rank GPU metrics")
    assert [v for lab, v in m["profagent_process_gpu_sm_utilization_ratio"] if lab["rank"] == "0"] == [0.4]
    assert [v for lab, v in m["profagent_process_gpu_memory_used_bytes"] if lab["rank"] == "0"] == [1024 * 1024 * 1024]
    assert sorted(v for _, v in m["profagent_gpu_up"]) == [1.0, 1.0]
    assert not [lab for lab, _ in m.get("profagent_collector_errors_total", []) if lab["collector"] == "gpu"]
    assert agent.stop() == 0
    assert "Traceback" not in agent.output

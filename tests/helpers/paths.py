"""Where things are: this checkout, the test workloads and the shared fixtures folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ROOT / "tests" / "workloads"

# The shared fixtures (traces/gpu, nvml-mock) are not in the repository: they sit in a
# ``shared/`` folder next to the checkout, or further up for a git worktree, or anywhere
# this variable says.
# (Not PROFAGENT_*: the agent reads every such variable as a config key and refuses unknown ones.)
SHARED_ENV = "SHARED_FIXTURES_DIR"
NVML_MOCK_ENV = "NVML_MOCK_DIR"  # NVIDIA's mock NVML alone, anywhere (overrides shared/nvml-mock)



def shared_dir() -> Path:
    """$SHARED_FIXTURES_DIR if set, else the first ``shared/`` walking up from the checkout.

    Fails the calling test (or the collection of the module that calls it at import) with
    one line naming the expected folder and the variable when there is none.
    """
    env = os.environ.get(SHARED_ENV, "")
    if env:
        if Path(env).is_dir():
            return Path(env)
        pytest.fail(f"{SHARED_ENV}={env} is not a folder: point it at the shared fixtures (traces/gpu, nvml-mock)",
                    pytrace=False)
    found = next((d / "shared" for d in ROOT.parents if (d / "shared").is_dir()), None)
    if found is None:
        pytest.fail(f"shared fixtures not found: expected {ROOT.parent / 'shared'} (or a shared/ further up), "
                    f"or set {SHARED_ENV}", pytrace=False)
    return found


def shared_traces() -> Path:
    """The real GPU profiler traces: shared/traces/gpu."""
    return shared_dir() / "traces" / "gpu"


def nvml_mock_dir() -> Path:
    """NVIDIA's mock NVML: $NVML_MOCK_DIR if set, else shared/nvml-mock.

    Fails (one line) when ``libnvidia-ml.so.1`` is not there: the GPU tests must not pass
    by being skipped.
    """
    env = os.environ.get(NVML_MOCK_ENV)
    folder = Path(env) if env else shared_dir() / "nvml-mock"
    if not (folder / "libnvidia-ml.so.1").is_file():
        pytest.fail(f"NVIDIA's mock NVML not found: no libnvidia-ml.so.1 in {folder} "
                    f"(set {NVML_MOCK_ENV} or {SHARED_ENV})", pytrace=False)
    return folder

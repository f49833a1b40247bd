"""Where things are: this checkout, the test workloads and the shared fixtures folder."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ROOT / "tests" / "workloads"

# The shared fixtures (traces/gpu, nvml-mock) are not in the repository: they sit in a
# ``shared/`` folder next to the checkout, or further up for a git worktree, or anywhere
# this variable says.
SHARED_ENV = "PROFAGENT_SHARED_DIR"
NVML_MOCK_ENV = "NVML_MOCK_DIR"  # NVIDIA's mock NVML alone, anywhere (overrides shared/nvml-mock)


@functools.cache
def take_shared_env() -> str:
    """$PROFAGENT_SHARED_DIR ("" if unset), taken out of the environment on the first call.

    Every PROFAGENT_* variable is a config key to the agent, which refuses unknown ones
    (exit 2), and the tests' children inherit the environment: conftest.py calls this as
    the session starts, so no agent a test starts ever sees it.
    """
    return os.environ.pop(SHARED_ENV, "")


def shared_dir() -> Path:
    """$PROFAGENT_SHARED_DIR if set, else the first ``shared/`` walking up from the checkout.

    Fails the calling test (or the collection of the module that calls it at import) with
    one line naming the expected folder and the variable when there is none.
    """
    env = take_shared_env()
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
    """NVIDIA's mock NVML: $NVML_MOCK_DIR if set, else shared/nvml-mock."""
    env = os.environ.get(NVML_MOCK_ENV)
    return Path(env) if env else shared_dir() / "nvml-mock"

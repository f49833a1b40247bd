"""Durations must be finite and bounded; PIDs that are not a job are refused with one line."""

from __future__ import annotations

import pytest

from profagent.config import load_config
from profagent.errors import UserError
from profagent.target.pid import check_attachable


@pytest.mark.parametrize("key", ["interval", "stacks.window", "traces.settle_seconds", "watch.scan_interval"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e300, -1.0])
def test_durations_finite_and_bounded(key: str, value: float) -> None:
    with pytest.raises(UserError):
        load_config(None, {}, {key: value})


@pytest.mark.parametrize("pid", [-5, 0, 1, 2])
def test_pids_that_are_not_a_job(pid: int) -> None:
    with pytest.raises(UserError) as exc:
        check_attachable(pid)
    assert "\n" not in str(exc.value)

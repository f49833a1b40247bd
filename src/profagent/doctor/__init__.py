"""`profagent doctor`: check the environment, and say how to fix what doesn't work.

Each check is a function returning one or more ``Check`` rows; a check must never
raise (it reports its own failure as a row). Each source's checks live in
``doctor/<source>.py``; this package depends only downward (on sources and config).
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable, Iterable

import psutil

from profagent import __version__
from profagent.config import Config
from profagent.doctor.check import FAIL, OK, WARN, Check
from profagent.doctor.gpu import check_nvml
from profagent.doctor.ondemand import check_ondemand
from profagent.doctor.stacks import check_pyspy
from profagent.doctor.timeline import check_timeline

__all__ = ["CHECKS", "FAIL", "OK", "WARN", "Check", "run_checks"]


def check_runtime(config: Config) -> Iterable[Check]:
    yield Check("agent", "profagent", OK, f"{__version__} on Python {platform.python_version()} ({sys.platform})")
    try:
        psutil.Process(1).cmdline()
        yield Check("agent", "/proc access", OK, "can read other processes")
    except psutil.AccessDenied:
        yield Check("agent", "/proc access", WARN, "cannot read PID 1", "run as root or the training job's user")
    except psutil.Error as exc:
        yield Check("agent", "/proc access", WARN, str(exc))


# Each entry takes the effective config and yields rows. Order = order in the table.
CHECKS: list[Callable[[Config], Iterable[Check]]] = [check_runtime, check_nvml, check_pyspy, check_ondemand, check_timeline]


def run_checks(config: Config, checks: Iterable[Callable[[Config], Iterable[Check]]] = CHECKS) -> list[Check]:
    rows: list[Check] = []
    for check in checks:
        try:
            rows.extend(check(config))
        except Exception as exc:  # a broken check is a finding, not a crash
            rows.append(Check("doctor", getattr(check, "__name__", "check"), FAIL, f"check crashed: {exc}"))
    return rows

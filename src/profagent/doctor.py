"""`profagent doctor`: check the environment, and say how to fix what doesn't work.

Each check is a function returning one or more ``Check`` rows; a check must never
raise (it reports its own failure as a row). Sources add their checks to ``CHECKS``.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psutil

from profagent import __version__
from profagent.agent.nvml.checks import check_nvml
from profagent.agent.pyspy import doctor_check as pyspy_doctor_check
from profagent.agent.sources.ondemand import doctor_check as ondemand_doctor_check
from profagent.config import Config

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    area: str
    name: str
    status: str  # ok, warn or fail
    detail: str
    fix: str = ""


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
CHECKS: list[Callable[[Config], Iterable[Check]]] = [check_runtime, check_nvml, pyspy_doctor_check, ondemand_doctor_check]


def run_checks(config: Config, checks: Iterable[Callable[[Config], Iterable[Check]]] = CHECKS) -> list[Check]:
    rows: list[Check] = []
    for check in checks:
        try:
            rows.extend(check(config))
        except Exception as exc:  # a broken check is a finding, not a crash
            rows.append(Check("doctor", getattr(check, "__name__", "check"), FAIL, f"check crashed: {exc}"))
    return rows

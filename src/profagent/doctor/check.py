"""A doctor row: what was checked, how it went, and how to fix it."""

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    area: str
    name: str
    status: str  # ok, warn or fail
    detail: str
    fix: str = ""

"""The exit status of a command is the process's: typer hands ``typer.Exit(n)`` back to
``main`` as a return value (standalone_mode=False), and ``main`` must not drop it."""

from __future__ import annotations

import sys

import pytest

import profagent.cli as cli
import profagent.doctor as doctor
from profagent.doctor.check import FAIL, OK, Check


def _doctor_with(monkeypatch, status: str) -> int | None:
    def checks(config):  # one row, as run_checks gives them
        return [Check("agent", "stand-in", status, "a check that " + status)]

    monkeypatch.setattr(doctor, "run_checks", checks)
    monkeypatch.setattr(sys, "argv", ["profagent", "doctor", "--gpu-backend", "off"])
    try:
        cli.main()
    except SystemExit as exc:
        return exc.code
    return None  # returned: exit status 0


def test_doctor_with_a_failing_check_exits_1(monkeypatch, capsys) -> None:
    assert _doctor_with(monkeypatch, FAIL) == 1
    assert "a check that fail" in capsys.readouterr().out


def test_doctor_with_every_check_ok_exits_0(monkeypatch, capsys) -> None:
    assert _doctor_with(monkeypatch, OK) in (None, 0)


@pytest.mark.parametrize("code", [0, 3])
def test_main_passes_on_the_status_a_command_returns(monkeypatch, code: int) -> None:
    monkeypatch.setattr(cli, "app", lambda standalone_mode: code)
    monkeypatch.setattr(sys, "argv", ["profagent"])
    if code:
        with pytest.raises(SystemExit) as exc:
            cli.main()
        assert exc.value.code == code
    else:
        cli.main()  # a success returns: in-process callers (tests) go on

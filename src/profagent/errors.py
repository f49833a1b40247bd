"""Errors that end a command with one line for the user (exit status 2, no traceback)."""

from __future__ import annotations


class UserError(Exception):
    """Bad input or environment. The message names the problem and the fix, on one line."""

    exit_code = 2

    def __init__(self, problem: str, fix: str | None = None) -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}: {fix}" if fix else problem)

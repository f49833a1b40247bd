"""The ``cmdline`` label: what a process is, without the secrets its arguments often carry.

By default only the program and the script (``python3 train.py``, ``python3 -m pkg``) are
kept: command lines routinely carry tokens and passwords, and the label is served on the
network. With ``agent.cmdline_args = true`` the arguments are kept too, but the value of
any option whose name mentions a key, token, secret or password is replaced by ``***``.
"""

from __future__ import annotations

import os
import re

REDACTED = "***"
_SECRET_OPTION = re.compile(r"^-{1,2}[\w.-]*(key|token|secret|passw(or)?d|pwd|credential|auth)[\w.-]*$", re.IGNORECASE)
_INTERPRETER = re.compile(r"^(python[\d.]*|pypy[\d.]*|bash|sh|perl|ruby|node)$")


def label_cmdline(argv: list[str], with_args: bool = False) -> str:
    """The command line as the ``cmdline`` label shows it (not yet shortened)."""
    if not argv:
        return ""
    program = os.path.basename(argv[0])
    if with_args:
        return " ".join([program, *redact(argv[1:])])
    if not _INTERPRETER.match(program):
        return program
    rest = argv[1:]
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "-m" and i + 1 < len(rest):
            return f"{program} -m {rest[i + 1]}"
        if arg == "-c":
            return f"{program} -c"
        if not arg.startswith("-"):
            return f"{program} {os.path.basename(arg)}"
        i += 1
    return program


def redact(args: list[str]) -> list[str]:
    """Arguments with secret option values replaced: ``--api-key=X`` and ``--api-key X``."""
    out: list[str] = []
    hide_next = False
    for arg in args:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        name, eq, _ = arg.partition("=")
        if _SECRET_OPTION.match(name):
            if eq:
                out.append(f"{name}={REDACTED}")
            else:
                out.append(name)
                hide_next = True
            continue
        out.append(arg)
    return out

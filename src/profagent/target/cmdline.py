"""The ``cmdline`` label: what a process is, without the secrets its arguments often carry.

By default only the program and the script (``python3 train.py``, ``python3 -m pkg``) are
kept: command lines routinely carry tokens and passwords, and the label is served on the
network. ``agent.cmdline_args = true`` keeps the arguments, secrets replaced by ``***``.
"""

from __future__ import annotations

import os
import re

# With ``agent.cmdline_args = true``, every value that looks secret is replaced by ``***``:
#
# - the value of an option whose name mentions a secret (key, token, secret, pass, pwd,
#   cred, auth, jwt, bearer, cookie, session, private, signature), after ``=`` or in the
#   next argument (``--api-key=X``, ``--pass X``, ``--jwt X``);
# - the value of ``-p`` (``mysql -p X``, ``psql``-like tools): a ``-p 8`` that means a port
#   or a count is hidden too, the safe side of an ambiguity the agent cannot resolve;
# - ``NAME=VALUE`` where NAME mentions a secret (``HF_TOKEN=X``, ``db.password=X``);
# - the password of a URL (``postgres://user:***@host``) and a ``Bearer`` token, anywhere.
#
# Words are matched inside names, so an unrelated option that contains one (``--keep``
# does not, ``--bypass`` does) is hidden too: over-hiding costs a label, a leak a secret.
REDACTED = "***"
_SECRET_WORD = r"(key|token|secret|pass|pwd|cred|auth|jwt|bearer|cookie|session|private|signature)"
_SECRET_OPTION = re.compile(rf"^(-{{1,2}}[\w.-]*{_SECRET_WORD}[\w.-]*|-p)$", re.IGNORECASE)
_SECRET_ASSIGNMENT = re.compile(rf"^([A-Za-z_][\w.-]*{_SECRET_WORD}[\w.-]*)=.*$", re.IGNORECASE | re.DOTALL)
_URL_PASSWORD = re.compile(r"([a-z][a-z0-9+.-]*://[^/\s:@]*):[^/\s@]*@", re.IGNORECASE)
_BEARER = re.compile(r"\b(bearer)\s+\S+", re.IGNORECASE)
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
    """Arguments with every secret-looking value replaced (see the module doc)."""
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
        assignment = _SECRET_ASSIGNMENT.match(arg)
        if assignment:
            out.append(f"{assignment.group(1)}={REDACTED}")
            continue
        out.append(_BEARER.sub(rf"\1 {REDACTED}", _URL_PASSWORD.sub(rf"\1:{REDACTED}@", arg)))
    return out

"""The project's error vocabulary. The short, bounded label is always ``.reason``; the
one line for people is always a ``problem`` and a ``fix``, kept as fields.
"""

from __future__ import annotations


# - ``UserError(problem, fix)``: bad input or environment; ends a command with one line
#   (exit 2).
# - ``SourceError(message, reason)``: a failed source tick, counted by ``reason`` in
#   profagent_collector_errors_total. Its kinds:
#   - ``SourceUnavailable(problem, fix, reason)``: the source
#     cannot run here (no driver, ptrace denied...); it is turned off, the others go on.
#   - ``SourceWaiting``: the source cannot run now and retries by itself (an endpoint
#     another process holds): off with its reason while it waits, its loop goes on.
#   - ``TargetGone``: the observed process exited during the tick; not worth logging.
#
# Errors of one part map onto these: TraceError and MalformedDatagram are SourceErrors
# (``reason`` names what was wrong), PySpyProblem is a SourceUnavailable, NoPollers a UserError.
class UserError(Exception):
    """Bad input or environment. The message names the problem and the fix, on one line."""

    exit_code = 2

    def __init__(self, problem: str, fix: str | None = None) -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}: {fix}" if fix else problem)


class SourceError(Exception):
    """A failed tick. ``reason`` is a short, bounded label for collector_errors_total."""

    reason = "error"

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        if reason:
            self.reason = reason


class SourceUnavailable(SourceError):
    """The source cannot run here. ``problem`` and ``fix`` make the one line for the user
    (``problem: fix``); the source is turned off and the others go on."""

    reason = "unavailable"

    def __init__(self, problem: str, fix: str = "", reason: str | None = None) -> None:
        super().__init__(f"{problem}: {fix}" if fix else problem, reason)
        self.problem = problem
        self.fix = fix


class NotApplicable(SourceUnavailable):
    """The source has nothing to do on this node (no GPU, the endpoint is another agent's):
    off, but no fault. ``why`` is a short closed code exported as the reason label."""

    reason = "not_applicable"

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


class SourceWaiting(SourceError):
    """The source cannot run now and retries by itself (its endpoint is held by another
    process): off, with this line and ``why`` (a short closed code, the reason label), until
    it can; its loop goes on."""

    reason = "waiting"

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


class TargetGone(SourceError):
    """The process being observed exited during the tick. Not an error worth logging."""

    reason = "target_gone"

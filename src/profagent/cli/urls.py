"""The one check of an agent URL given with --url (top, diagnose, incidents)."""

from __future__ import annotations

from urllib.parse import SplitResult, urlsplit

from profagent.errors import UserError


def parse_agent_url(url: str) -> SplitResult:
    """``url`` split, with a scheme (http by default), a host and a valid port; UserError
    (one line, exit 2) for anything urllib would trip on later (``http://[::1``, a port
    that is not a number, control characters)."""
    fix = "give the agent's address, e.g. http://127.0.0.1:19400 or http://[::1]:19400"
    shown = url.encode("unicode_escape", "backslashreplace").decode()
    if any(ord(c) < 0x21 or 0x7F <= ord(c) <= 0x9F for c in url):
        raise UserError(f"bad --url {shown!r}: it holds spaces or control characters", fix)
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise UserError(f"bad --url {shown!r} ({exc})", fix) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"bad --url {shown!r}", fix)
    return parts

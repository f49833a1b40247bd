"""The one check of an agent URL given with --url (top, diagnose, incidents)."""

from __future__ import annotations

import base64
import ssl
import urllib.request
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


def json_request(target: str, basic_auth: str | None = None, ca_file: str | None = None,
                 insecure: bool = False) -> tuple[urllib.request.Request, ssl.SSLContext | None]:
    """A GET of JSON at ``target`` with basic auth (USER:PASS) and TLS (a CA file, or no
    check with ``insecure``), for the commands that read an agent or a Prometheus."""
    request = urllib.request.Request(target, headers={"Accept": "application/json"})
    if basic_auth:
        user, sep, _ = basic_auth.partition(":")
        if not sep or not user:
            raise UserError("--basic-auth must be USER:PASS", "e.g. --basic-auth prometheus:secret")
        request.add_header("Authorization", "Basic " + base64.b64encode(basic_auth.encode()).decode())
    context = None
    if target.startswith("https"):
        context = ssl.create_default_context(cafile=ca_file)
        if insecure:
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return request, context

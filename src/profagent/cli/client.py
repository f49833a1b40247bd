"""The one HTTP client of the commands that read an agent or a Prometheus (``--url``,
``--prometheus``): the URL checked once, basic auth (flag, file or environment) and TLS
(a CA file, or no check), with the same flags on every command."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import SplitResult, urlencode, urlsplit

import typer

from profagent.errors import UserError

if TYPE_CHECKING:
    import ssl

# ssl, urllib.request and orjson are imported where a request is made: every command's
# start-up imports this module for its flags.

BasicAuthOpt = Annotated[str | None, typer.Option(
    "--basic-auth", envvar="PROFAGENT_BASIC_AUTH",
    help="USER:PASS when the agent's web config (or Prometheus) asks for basic auth")]
BasicAuthFileOpt = Annotated[Path | None, typer.Option(
    "--basic-auth-file", help="file holding USER:PASS (keeps the password out of `ps`)")]
CaFileOpt = Annotated[Path | None, typer.Option("--ca-file", help="CA certificate to verify an https agent (or Prometheus)")]
InsecureOpt = Annotated[bool, typer.Option("--insecure", help="do not verify the https agent's (or Prometheus') certificate")]

TLS_FIX = "give --ca-file with the server's CA (or --insecure)"


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


@dataclass(frozen=True)
class ClientAuth:
    """Credentials and TLS trust for one server."""

    basic_auth: str | None = None  # USER:PASS
    ca_file: str | None = None
    insecure: bool = False


NO_AUTH = ClientAuth()


def client_auth(basic_auth: str | None = None, basic_auth_file: Path | None = None, ca_file: Path | None = None,
                insecure: bool = False) -> ClientAuth:
    """The flags made one ``ClientAuth``: the file wins over the flag (and its environment
    variable); USER:PASS is checked here, before any request."""
    if basic_auth_file is not None:
        try:
            basic_auth = basic_auth_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read {basic_auth_file} ({getattr(exc, 'strerror', None) or exc})",
                            "check --basic-auth-file") from None
    if basic_auth:
        user, sep, _ = basic_auth.partition(":")
        if not sep or not user:
            raise UserError("--basic-auth must be USER:PASS", "give --basic-auth USER:PASS or a file holding USER:PASS")
    return ClientAuth(basic_auth or None, str(ca_file) if ca_file else None, insecure)


class JsonClient:
    """GETs of one server at ``url`` (its path kept as a prefix, a trailing ``/metrics``
    dropped) with ``auth``. ``what`` names the server in errors ("the agent", "Prometheus")."""

    def __init__(self, url: str, auth: ClientAuth, what: str = "the agent", timeout: float = 10.0,
                 reach_fix: str = "check --url and that `profagent attach` or `watch` runs") -> None:
        parts = parse_agent_url(url)
        self.shown = parts.geturl()
        self.base = f"{parts.scheme}://{parts.netloc}" + parts.path.rstrip("/").removesuffix("/metrics")
        self.what, self.timeout, self.reach_fix = what, timeout, reach_fix
        self.headers = {"Accept": "application/json"}
        if auth.basic_auth:
            self.headers["Authorization"] = "Basic " + base64.b64encode(auth.basic_auth.encode()).decode()
        self.context: ssl.SSLContext | None = None
        if parts.scheme == "https":
            import ssl

            try:
                self.context = ssl.create_default_context(cafile=auth.ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise UserError(f"cannot load the CA file {auth.ca_file} ({exc})", "check --ca-file") from None
            if auth.insecure:
                self.context.check_hostname, self.context.verify_mode = False, ssl.CERT_NONE

    def url(self, path: str, query: Mapping[str, str | list[str]] | None = None) -> str:
        return self.base + path + (f"?{urlencode(query, doseq=True)}" if query else "")

    def get(self, path: str, query: Mapping[str, str | list[str]] | None = None, limit: int = 64 << 20) -> tuple[int, bytes]:
        """The status and at most ``limit`` + 1 bytes of the body (an HTTP error's too);
        UserError when the server cannot be reached or TLS fails."""
        import ssl
        import urllib.error
        import urllib.request

        request = urllib.request.Request(self.url(path, query), headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self.context) as resp:
                return resp.status, resp.read(limit + 1)
        except urllib.error.HTTPError as exc:
            try:
                return exc.code, exc.read(limit + 1)
            except OSError:
                return exc.code, b""
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, ssl.SSLError):
                raise UserError(f"TLS to {self.shown} failed ({reason.reason})", TLS_FIX) from None
            raise UserError(f"cannot reach {self.what} at {self.shown} ({reason})", self.reach_fix) from None

    def get_json(self, path: str, query: Mapping[str, str | list[str]] | None = None, limit: int = 64 << 20,
                 not_found: tuple[str, str] | None = None) -> Any:
        """The JSON answer to a GET. UserError, one line, for a refused login (401), a 404
        (``not_found``: the problem and fix, else "has no PATH"), any other status, an answer
        over ``limit`` bytes, or one that is not JSON."""
        import orjson

        status, body = self.get(path, query, limit)
        where = self.url(path, query)
        if status == 401:
            raise UserError(f"{self.what} at {self.shown} asks for a password (or refused it)",
                            "give --basic-auth USER:PASS (or --basic-auth-file) as in its web config")
        if status == 404:
            problem, fix = not_found or (f"{self.shown} has no {path}", f"upgrade {self.what}, or check --url")
            raise UserError(problem, fix)
        if status != 200:
            detail = body[:200].decode(errors="replace").strip()
            raise UserError(f"{where} answered HTTP {status}" + (f": {detail}" if detail else ""), "see its log")
        if len(body) > limit:
            raise UserError(f"{where} answered more than {limit >> 20} MiB", "narrow the request")
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            raise UserError(f"{where} did not answer JSON", f"check that --url points at {self.what}") from None

"""exporter-toolkit's ``web-config.yml``, read with exporter-toolkit's meaning.

node_exporter users bring this file: a key read differently would silently change their
security, so every key we cannot honour is refused at start, in one line (the list is above
``CLIENT_AUTH_TYPES``).
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt
import yaml

from profagent.errors import UserError

MAX_WEB_CONFIG_BYTES = 1024 * 1024

# node_exporter users bring this file; where we read a key differently their security would
# silently change, so every key we accept does what exporter-toolkit does
# (web-configuration.md and web/tls_config.go of prometheus/exporter-toolkit), and
# every key or value we cannot honour is refused at start, in one line:
#
# - ``RequireAnyClientCert`` (a certificate required, never verified) cannot be expressed
#   with Python's ``ssl``, which verifies every certificate it asks for; refused.
# - ``RequestClientCert`` asks for a certificate and never verifies or requires it: every
#   client is served, with or without one, so we do not ask (same outcome); with
#   ``client_allowed_sans`` it would need the unverified certificate: refused.
# - Inline ``cert``/``key``/``client_ca``, ``rate_limit`` and more than one
#   ``curve_preferences`` entry are not implemented: refused.
# - ``http2: true`` is accepted: HTTP/2 is an optional upgrade that clients negotiate; we
#   offer HTTP/1.1 only, which every Prometheus speaks.
CLIENT_AUTH_TYPES = ("NoClientCert", "RequestClientCert", "RequireAnyClientCert", "VerifyClientCertIfGiven",
                     "RequireAndVerifyClientCert")
_VERIFYING = ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert")
TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
# Go's crypto/tls names (tls.CipherSuites()) and their IANA ids; OpenSSL knows them by id.
GO_CIPHER_SUITES = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": 0x002F, "TLS_RSA_WITH_AES_256_CBC_SHA": 0x0035,
    "TLS_RSA_WITH_AES_128_GCM_SHA256": 0x009C, "TLS_RSA_WITH_AES_256_GCM_SHA384": 0x009D,
    "TLS_AES_128_GCM_SHA256": 0x1301, "TLS_AES_256_GCM_SHA384": 0x1302, "TLS_CHACHA20_POLY1305_SHA256": 0x1303,
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": 0xC009, "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": 0xC00A,
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": 0xC013, "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": 0xC014,
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": 0xC02B, "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": 0xC02C,
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": 0xC02F, "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": 0xC030,
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": 0xCCA8, "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": 0xCCA9,
}
_TLS13_SUITES = (0x1301, 0x1302, 0x1303)  # Go ignores cipher_suites for TLS 1.3, so do we
CURVES = {"CurveP256": "prime256v1", "CurveP384": "secp384r1", "CurveP521": "secp521r1", "X25519": "X25519"}
# exporter-toolkit's extraHTTPHeaders: the only headers it lets a config set (None = any value).
HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}
_TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "client_allowed_sans", "min_version",
             "max_version", "cipher_suites", "prefer_server_cipher_suites", "curve_preferences"}
_HTTP_KEYS = {"http2", "headers"}
_NOT_IMPLEMENTED = {"cert": "use cert_file", "key": "use key_file", "client_ca": "use client_ca_file",
                    "rate_limit": "remove it (profagent has its own caps, see http.* in docs/configuration.md)"}


@dataclass(frozen=True)
class WebConfig:
    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""
    client_auth_type: str = ""
    client_allowed_sans: tuple[str, ...] = ()
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    cipher_suites: tuple[str, ...] = ()
    prefer_server_cipher_suites: bool = True
    curve_preferences: tuple[str, ...] = ()
    users: dict[str, bytes] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def tls(self) -> bool:
        return bool(self.cert_file)


def _read(path: Path) -> Any:
    """Open without following a final symlink and without blocking (a FIFO would hang us),
    and read only a regular file, up to a cap."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UserError(f"web config {path} not found", "check the --web-config path") from None
    except PermissionError:
        raise UserError(f"cannot read web config {path}", "fix its permissions") from None
    except OSError as exc:
        if os.path.islink(path):
            raise UserError(f"web config {path} is a symbolic link", f"pass the file itself ({os.path.realpath(path)})") from None
        raise UserError(f"cannot read web config {path} ({exc.strerror})", "pass a readable YAML file") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise UserError(f"web config {path} is a directory", "pass the web-config.yml file itself")
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"web config {path} is not a regular file", "pass the web-config.yml file itself")
        if info.st_size > MAX_WEB_CONFIG_BYTES:
            raise UserError(f"web config {path} is larger than {MAX_WEB_CONFIG_BYTES} bytes", "pass the web-config.yml file itself")
        with os.fdopen(os.dup(fd), "rb") as fh:
            text = fh.read(MAX_WEB_CONFIG_BYTES + 1).decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read web config {path} ({exc})", "pass a readable YAML file") from None
    finally:
        os.close(fd)
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        detail = str(exc).splitlines()[0]
        raise UserError(f"malformed web config {path} ({detail})", "fix the YAML syntax") from None


def _mapping(data: dict, key: str, path: Path) -> dict:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise UserError(f"malformed web config {path}: {key} must be a mapping", "see exporter-toolkit's docs/web-configuration.md")
    return value


def _check_keys(section: str, given: dict, known: set[str], path: Path) -> None:
    for key in given:
        if key in _NOT_IMPLEMENTED:
            raise UserError(f"'{section}{key}' in web config {path} is not implemented by profagent", _NOT_IMPLEMENTED[key])
        if key not in known:
            raise UserError(f"unknown key '{section}{key}' in web config {path}", f"supported: {', '.join(sorted(known))}")


def _strings(value: Any, key: str, path: Path) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserError(f"'{key}' in web config {path} must be a list of strings", "see exporter-toolkit's docs/web-configuration.md")
    return tuple(value)


def _choice(value: str, allowed: Any, key: str, path: Path) -> str:
    if value not in allowed:
        raise UserError(f"unknown {key} {value!r} in web config {path}", f"use one of {', '.join(allowed)}")
    return value


def load_web_config(path: str | Path) -> WebConfig:
    """Parse web-config.yml. Raises UserError when it is unreadable, malformed, or asks for
    something profagent cannot do as exporter-toolkit does."""
    path = Path(path)
    data = _read(path)
    if not isinstance(data, dict):
        raise UserError(f"malformed web config {path}", "expected tls_server_config and/or basic_auth_users")
    _check_keys("", data, {"tls_server_config", "basic_auth_users", "http_server_config"}, path)
    tls, users, http = (_mapping(data, k, path) for k in ("tls_server_config", "basic_auth_users", "http_server_config"))
    _check_keys("tls_server_config.", tls, _TLS_KEYS, path)
    _check_keys("http_server_config.", http, _HTTP_KEYS, path)
    base = path.parent

    def resolve(p: Any) -> str:  # relative paths are relative to the web config, as in exporter-toolkit
        p = str(p or "")
        return str(base / p) if p and not Path(p).is_absolute() else p

    cfg = WebConfig(
        cert_file=resolve(tls.get("cert_file")),
        key_file=resolve(tls.get("key_file")),
        client_ca_file=resolve(tls.get("client_ca_file")),
        client_auth_type=_choice(str(tls.get("client_auth_type") or "NoClientCert"), CLIENT_AUTH_TYPES, "client_auth_type", path),
        client_allowed_sans=_strings(tls.get("client_allowed_sans"), "client_allowed_sans", path),
        min_version=_choice(str(tls.get("min_version") or "TLS12"), TLS_VERSIONS, "min_version", path),
        max_version=_choice(str(tls.get("max_version") or "TLS13"), TLS_VERSIONS, "max_version", path),
        cipher_suites=tuple(_choice(c, GO_CIPHER_SUITES, "cipher suite", path)
                            for c in _strings(tls.get("cipher_suites"), "cipher_suites", path)),
        prefer_server_cipher_suites=bool(tls.get("prefer_server_cipher_suites", True)),
        curve_preferences=tuple(_choice(c, CURVES, "curve", path)
                                for c in _strings(tls.get("curve_preferences"), "curve_preferences", path)),
        users=_users(users, path),
        headers=_headers(http.get("headers") or {}, path),
    )
    _check_tls(cfg, tls, path)
    return cfg


def _users(users: dict, path: Path) -> dict[str, bytes]:
    for user, hashed in users.items():
        if not str(hashed).startswith("$2"):
            raise UserError(f"password of user {user!r} in {path} is not a bcrypt hash", "generate one with `htpasswd -nBC 10 USER`")
        try:  # a malformed hash would otherwise fail on every authenticated request
            bcrypt.checkpw(b"", str(hashed).encode())
        except ValueError:
            raise UserError(f"the bcrypt hash of user {user!r} in {path} is malformed", "generate one with `htpasswd -nBC 10 USER`") from None
    return {str(u): str(h).encode() for u, h in users.items()}


def _headers(headers: Any, path: Path) -> dict[str, str]:
    if not isinstance(headers, dict):
        raise UserError(f"'http_server_config.headers' in web config {path} must be a mapping", "see exporter-toolkit's docs/web-configuration.md")
    for name, value in headers.items():
        if name not in HEADERS:
            raise UserError(f"HTTP header {name!r} in web config {path} can not be configured", f"use one of {', '.join(HEADERS)}")
        allowed = HEADERS[name]
        if allowed is not None and value not in allowed:
            raise UserError(f"invalid value {value!r} for {name} in web config {path}", f"use one of {', '.join(allowed)}")
        if any(c in str(value) for c in "\r\n\0"):
            raise UserError(f"the value of {name} in web config {path} holds a line break", "write it on one line")
    return {str(k): str(v) for k, v in headers.items() if str(v)}  # blank = unset


def _check_tls(cfg: WebConfig, tls: dict, path: Path) -> None:
    if bool(cfg.cert_file) != bool(cfg.key_file):
        raise UserError(f"web config {path} sets only one of cert_file/key_file", "set both")
    if (tls.get("client_auth_type") or cfg.client_ca_file or cfg.client_allowed_sans) and not cfg.cert_file:
        raise UserError(f"client certificates in {path} need TLS", "set cert_file and key_file")
    if cfg.client_auth_type == "RequireAnyClientCert":
        raise UserError(f"client_auth_type RequireAnyClientCert in {path} is not implemented by profagent (Python's TLS verifies every certificate it requires)",
                        "use RequireAndVerifyClientCert with client_ca_file")
    if cfg.client_auth_type in _VERIFYING and not cfg.client_ca_file:
        raise UserError(f"client_auth_type {cfg.client_auth_type} in {path} needs client_ca_file", "set client_ca_file to the CA that signs client certificates")
    if cfg.client_ca_file and cfg.client_auth_type == "NoClientCert":
        raise UserError(f"client_ca_file in {path} is set without a client_auth_type", "set client_auth_type: RequireAndVerifyClientCert")
    if cfg.client_allowed_sans and cfg.client_auth_type not in _VERIFYING:
        raise UserError(f"client_allowed_sans in {path} needs verified client certificates",
                        "set client_auth_type: RequireAndVerifyClientCert (or VerifyClientCertIfGiven) and client_ca_file")
    if TLS_VERSIONS[cfg.min_version] > TLS_VERSIONS[cfg.max_version]:
        raise UserError(f"min_version {cfg.min_version} is above max_version {cfg.max_version} in {path}", "lower min_version")
    if len(cfg.curve_preferences) > 1:
        raise UserError(f"more than one curve_preferences entry in {path} is not implemented by profagent", "keep one curve")


def ssl_context(cfg: WebConfig) -> ssl.SSLContext:
    """The server context for ``cfg`` (UserError when a file cannot be loaded)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        if cfg.client_ca_file:
            ctx.load_verify_locations(cfg.client_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise UserError(f"cannot load TLS certificate or key ({exc})", "check cert_file/key_file/client_ca_file in the web config") from None
    try:
        ctx.minimum_version = TLS_VERSIONS[cfg.min_version]
        ctx.maximum_version = TLS_VERSIONS[cfg.max_version]
        if cfg.cipher_suites:
            _set_ciphers(ctx, cfg)
        if cfg.curve_preferences:
            ctx.set_ecdh_curve(CURVES[cfg.curve_preferences[0]])
    except (ssl.SSLError, ValueError) as exc:
        raise UserError(f"cannot set up TLS as the web config asks ({exc})", "check min_version, max_version, cipher_suites and curve_preferences") from None
    if cfg.prefer_server_cipher_suites:
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    # RequestClientCert: exporter-toolkit asks but never verifies nor requires, so every client
    # is served; not asking gives that outcome (Python's TLS would verify what it asks for).
    ctx.verify_mode = {"VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
                       "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}.get(cfg.client_auth_type, ssl.CERT_NONE)
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def _set_ciphers(ctx: ssl.SSLContext, cfg: WebConfig) -> None:
    """Go's TLS 1.2 suites by OpenSSL's names, in the given order; TLS 1.3 ones are ignored,
    as Go does. A list with no TLS 1.2 suite leaves TLS 1.3 only, as in Go."""
    by_id = {c["id"] & 0xFFFF: c["name"] for c in _all_ciphers()}
    wanted = [GO_CIPHER_SUITES[n] for n in cfg.cipher_suites if GO_CIPHER_SUITES[n] not in _TLS13_SUITES]
    for name in cfg.cipher_suites:
        if GO_CIPHER_SUITES[name] not in _TLS13_SUITES and GO_CIPHER_SUITES[name] not in by_id:
            raise ValueError(f"cipher suite {name} is not available in this OpenSSL")
    if wanted:
        ctx.set_ciphers(":".join(by_id[i] for i in wanted))
    elif cfg.max_version != "TLS13":
        raise ValueError("cipher_suites holds TLS 1.3 suites only but max_version is below TLS13")
    else:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3


def _all_ciphers() -> list[dict]:
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    probe.set_ciphers("ALL:@SECLEVEL=0")
    return probe.get_ciphers()


def peer_check(cfg: WebConfig) -> Callable[[ssl.SSLSocket], bool] | None:
    """exporter-toolkit's client_allowed_sans: the (verified) client certificate must carry
    one of these DNS, IP, e-mail or URI subject alternative names, exactly."""
    if not cfg.client_allowed_sans:
        return None
    allowed = set(cfg.client_allowed_sans)

    def check(sock: ssl.SSLSocket) -> bool:
        cert = sock.getpeercert()
        if not cert:
            return False
        for kind, value in cert.get("subjectAltName", ()):
            if kind == "IP Address":
                try:
                    value = str(ipaddress.ip_address(value.strip()))
                except ValueError:
                    continue
            if kind in ("DNS", "IP Address", "email", "URI") and value in allowed:
                return True
        return False

    return check

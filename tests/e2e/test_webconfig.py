"""Each web-config.yml key with exporter-toolkit's meaning, over real TLS on loopback, with
certificates made here by the openssl CLI: a CA, the server's, two clients signed by the
CA with different SANs, and a self-signed (unverified) client carrying an allowed SAN."""

from __future__ import annotations

import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from profagent.errors import UserError
from profagent.exporters.exposition import Exposition
from profagent.exporters.http import AgentHTTPServer, load_web_config
from profagent.state import State

Refused = "refused"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _signed(d: Path, name: str, san: str, ca: tuple[Path, Path] | None) -> tuple[Path, Path]:
    key, crt = d / f"{name}.key", d / f"{name}.pem"
    if ca is None:  # self-signed
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt), "-days", "1",
                 "-subj", f"/CN={name}", "-addext", f"subjectAltName={san}")
        return crt, key
    csr = d / f"{name}.csr"
    _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    ext = d / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial", "-out", str(crt),
             "-days", "1", "-extfile", str(ext))
    return crt, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("pki")
    ca = (d / "ca.pem", d / "ca.key")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca[1]), "-out", str(ca[0]), "-days", "1",
             "-subj", "/CN=test-ca", "-addext", "basicConstraints=critical,CA:TRUE")
    return {
        "ca": ca,
        "server": _signed(d, "server", "IP:127.0.0.1", ca),
        "prom": _signed(d, "prom", "DNS:prom.example,URI:spiffe://prom", ca),
        "other": _signed(d, "other", "DNS:other.example,IP:127.0.0.9", ca),
        "rogue": _signed(d, "rogue", "DNS:prom.example", None),
    }


@pytest.fixture
def serve(tmp_path: Path, pki) -> Iterator:
    servers: list[AgentHTTPServer] = []

    def start(tls_extra: str = "", top_extra: str = "") -> AgentHTTPServer:
        crt, key = pki["server"]
        path = tmp_path / f"web{len(servers)}.yml"
        path.write_text(f"tls_server_config:\n  cert_file: {crt}\n  key_file: {key}\n{tls_extra}{top_extra}")
        server = AgentHTTPServer("127.0.0.1", 0, Exposition(State().view), load_web_config(path))
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()


def fetch(server: AgentHTTPServer, pki, client: str | None = None, *, max_version: ssl.TLSVersion | None = None,
          ciphers: str | None = None, curve: str | None = None, alpn: list[str] | None = None,
          info: dict | None = None) -> int | str:
    """GET /metrics over TLS; the status, or Refused when the handshake or the first read fails."""
    ctx = ssl.create_default_context(cafile=str(pki["ca"][0]))
    if client:
        ctx.load_cert_chain(*map(str, pki[client]))
    if max_version:
        ctx.maximum_version = max_version
    if ciphers:
        ctx.set_ciphers(ciphers)
    if curve:
        ctx.set_ecdh_curve(curve)
    if alpn:
        ctx.set_alpn_protocols(alpn)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as raw, \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            if info is not None:
                info.update(version=s.version(), cipher=s.cipher()[0], alpn=s.selected_alpn_protocol())
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            if info is not None:
                info["head"] = data.split(b"\r\n\r\n")[0]
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        return Refused
    return int(data.split()[1]) if data else Refused


def test_request_client_cert_serves_clients_with_unverified_or_no_certificate(serve, pki) -> None:
    server = serve("  client_auth_type: RequestClientCert\n")
    assert fetch(server, pki) == 200
    assert fetch(server, pki, "rogue") == 200  # exporter-toolkit never verifies it
    assert fetch(server, pki, "prom") == 200


def test_verify_client_cert_if_given(serve, pki) -> None:
    server = serve(f"  client_auth_type: VerifyClientCertIfGiven\n  client_ca_file: {pki['ca'][0]}\n")
    assert fetch(server, pki) == 200
    assert fetch(server, pki, "prom") == 200
    assert fetch(server, pki, "rogue") == Refused


def test_require_and_verify_client_cert(serve, pki) -> None:
    server = serve(f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki['ca'][0]}\n")
    assert fetch(server, pki) == Refused
    assert fetch(server, pki, "rogue") == Refused
    assert fetch(server, pki, "prom") == 200


def test_client_allowed_sans(serve, pki) -> None:
    base = f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki['ca'][0]}\n"
    server = serve(base + "  client_allowed_sans: [prom.example]\n")
    assert fetch(server, pki, "prom") == 200
    assert fetch(server, pki, "other") == Refused  # signed by the CA, but not an allowed SAN
    assert fetch(server, pki, "rogue") == Refused  # the allowed SAN, but unverified
    by_ip = serve(base + "  client_allowed_sans: ['127.0.0.9']\n")
    assert fetch(by_ip, pki, "other") == 200 and fetch(by_ip, pki, "prom") == Refused
    by_uri = serve(base + "  client_allowed_sans: ['spiffe://prom']\n")
    assert fetch(by_uri, pki, "prom") == 200 and fetch(by_uri, pki, "other") == Refused


def test_min_and_max_version(serve, pki) -> None:
    info: dict = {}
    default = serve()
    assert fetch(default, pki, info=info) == 200 and info["version"] == "TLSv1.3"
    only13 = serve("  min_version: TLS13\n")
    assert fetch(only13, pki, max_version=ssl.TLSVersion.TLSv1_2) == Refused
    assert fetch(only13, pki) == 200
    only12 = serve("  max_version: TLS12\n")
    assert fetch(only12, pki, info=info) == 200 and info["version"] == "TLSv1.2"


def test_cipher_suites_and_server_preference(serve, pki) -> None:
    info: dict = {}
    one = serve("  max_version: TLS12\n  cipher_suites: [TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384]\n")
    assert fetch(one, pki, info=info) == 200 and info["cipher"] == "ECDHE-RSA-AES256-GCM-SHA384"
    assert fetch(one, pki, ciphers="ECDHE-RSA-AES128-GCM-SHA256") == Refused
    two = "  max_version: TLS12\n  cipher_suites: [TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384, TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256]\n"
    client_order = "ECDHE-RSA-AES128-GCM-SHA256:ECDHE-RSA-AES256-GCM-SHA384"
    server_first = serve(two)  # prefer_server_cipher_suites defaults to true
    assert fetch(server_first, pki, ciphers=client_order, info=info) == 200 and info["cipher"] == "ECDHE-RSA-AES256-GCM-SHA384"
    client_first = serve(two + "  prefer_server_cipher_suites: false\n")
    assert fetch(client_first, pki, ciphers=client_order, info=info) == 200 and info["cipher"] == "ECDHE-RSA-AES128-GCM-SHA256"


def test_curve_preferences(serve, pki) -> None:
    server = serve("  curve_preferences: [CurveP384]\n")
    assert fetch(server, pki, curve="prime256v1") == Refused
    assert fetch(server, pki, curve="secp384r1") == 200


def test_headers_and_http2(serve, pki) -> None:
    info: dict = {}
    server = serve(top_extra="http_server_config:\n  http2: true\n  headers:\n    X-Frame-Options: deny\n"
                             "    Strict-Transport-Security: max-age=31536000\n    X-XSS-Protection: ''\n")
    assert fetch(server, pki, alpn=["h2", "http/1.1"], info=info) == 200
    assert info["alpn"] == "http/1.1"  # HTTP/2 is offered by the client, HTTP/1.1 is what we speak
    head = info["head"].decode().lower()
    assert "x-frame-options: deny" in head and "strict-transport-security: max-age=31536000" in head
    assert "x-xss-protection" not in head  # blank = unset, as in exporter-toolkit


@pytest.mark.parametrize(("text", "words"), [
    ("  client_auth_type: RequireAnyClientCert\n", "RequireAnyClientCert in"),
    ("  client_ca_file: ca.pem\n", "without a client_auth_type"),
    ("  client_auth_type: RequestClientCert\n  client_allowed_sans: [x]\n", "needs verified client certificates"),
    ("  min_version: TLS13\n  max_version: TLS12\n", "above max_version"),
    ("  min_version: SSL3\n", "unknown min_version"),
    ("  cipher_suites: [TLS_RSA_WITH_RC4_128_SHA]\n", "unknown cipher suite"),
    ("  curve_preferences: [CurveP256, X25519]\n", "more than one curve_preferences"),
    ("  curve_preferences: [P256]\n", "unknown curve"),
    ("  cert: inline\n", "'tls_server_config.cert' in web config"),
    ("  sni: x\n", "unknown key 'tls_server_config.sni'"),
    ("http_server_config:\n  headers:\n    X-Powered-By: me\n", "can not be configured"),
    ("http_server_config:\n  headers:\n    X-Frame-Options: allow\n", "invalid value 'allow' for X-Frame-Options"),
    ("http_server_config:\n  foo: 1\n", "unknown key 'http_server_config.foo'"),
    ("rate_limit:\n  interval: 1s\n", "'rate_limit' in web config"),
])
def test_keys_not_implemented_or_invalid_are_refused_at_start(tmp_path: Path, pki, text: str, words: str) -> None:
    crt, key = pki["server"]
    path = tmp_path / "web.yml"
    path.write_text(f"tls_server_config:\n  cert_file: {crt}\n  key_file: {key}\n{text}")
    with pytest.raises(UserError) as exc:
        load_web_config(path)
    assert words in str(exc.value) and "\n" not in str(exc.value)

"""Who may ask, and who is asking: basic auth against the bcrypt hashes of ``web-config.yml``,
with failed logins delaying only the failing client's answers, and the key a peer is
counted under for the per-client caps. TLS (the context, the client-certificate check) is
webconfig.py's; the handshake runs in serving.py's I/O thread.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import bcrypt

AUTH_BACKOFF_FIRST = 0.1  # seconds the first failed login's answer is held; doubles per failure
AUTH_WINDOW = 60.0  # a client's failures are forgotten after this long without one
AUTH_CLIENTS_TRACKED = 4096  # oldest forgotten first: memory stays bounded under a spray

class Authenticator:
    """bcrypt is deliberately slow, so successful checks are remembered (as node_exporter
    does). A failed login is never a reason to refuse a correct password: failures only
    delay the failing answers of the client that fails (doubling up to ``backoff_max``).
    An unknown user is checked against a dummy hash of the same cost, so the answer time
    does not tell which user names exist."""

    def __init__(self, users: dict[str, bytes], backoff_max: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._users = users
        self._ok: set[bytes] = set()
        self._lock = threading.Lock()
        self._clock = clock
        self.backoff_max = backoff_max
        self._failures: OrderedDict[str, tuple[float, int]] = OrderedDict()  # client -> (last failure, count)
        cost = max((_bcrypt_cost(h) for h in users.values()), default=4)
        self._dummy = bcrypt.hashpw(b"profagent-no-such-user", bcrypt.gensalt(rounds=cost)) if users else b""

    @property
    def enabled(self) -> bool:
        return bool(self._users)

    def _parse(self, header: str | None) -> tuple[str, bytes] | None:
        if not header or not header.startswith("Basic "):
            return None
        try:
            user, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return None
        return user, password.encode()

    def _token(self, hashed: bytes, password: bytes) -> bytes:
        return hashlib.sha256(hashed + b"\0" + password).digest()

    def cached(self, header: str | None) -> bool:
        """True when the answer needs no bcrypt: no users, or credentials already proven."""
        if not self._users:
            return True
        parsed = self._parse(header)
        if parsed is None or parsed[0] not in self._users:
            return False
        token = self._token(self._users[parsed[0]], parsed[1])
        with self._lock:
            return token in self._ok

    def check(self, header: str | None) -> bool:
        if not self._users:
            return True
        parsed = self._parse(header)
        if parsed is None:
            return False
        user, password = parsed
        hashed = self._users.get(user)
        if hashed is None:
            bcrypt.checkpw(password, self._dummy)  # same work as a known user: no user enumeration
            return False
        token = self._token(hashed, password)
        with self._lock:
            if any(hmac.compare_digest(token, t) for t in self._ok):
                return True
        if not bcrypt.checkpw(password, hashed):
            return False
        with self._lock:
            self._ok.add(token)
        return True

    def failed(self, client: str) -> float:
        """Record a failure of ``client``; return how long to hold its answer (seconds)."""
        now = self._clock()
        with self._lock:
            last, count = self._failures.pop(client, (now, 0))
            if now - last >= AUTH_WINDOW:  # quiet for a window: start over
                count = 0
            count += 1
            self._failures[client] = (now, count)
            while len(self._failures) > AUTH_CLIENTS_TRACKED:
                self._failures.popitem(last=False)
        return min(self.backoff_max, AUTH_BACKOFF_FIRST * 2 ** min(count - 1, 30))


def _bcrypt_cost(hashed: bytes) -> int:
    try:
        return int(hashed.split(b"$")[2])
    except (IndexError, ValueError):
        return 10


def client_key(address: str) -> str:
    """Who a peer is, for the per-client caps: the IPv4 address, or the /64 of an IPv6
    one (a single host commonly holds a whole /64)."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{ip}/64", strict=False))
    return str(ip)


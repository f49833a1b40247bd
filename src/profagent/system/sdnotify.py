"""sd_notify(3) for ``Type=notify`` units: READY, WATCHDOG, RELOADING, STOPPING, STATUS.

A helper of our own rather than a dependency: the ``sdnotify`` package on PyPI has had
no release since 2017 and the protocol is one datagram per message, so twenty lines
are cheaper than an unmaintained dependency. The protocol: a ``KEY=VALUE`` newline
list sent as one datagram to the AF_UNIX socket in ``$NOTIFY_SOCKET``; a leading ``@``
names a socket in the abstract namespace. ``$WATCHDOG_USEC`` (for ``$WATCHDOG_PID``,
when set) asks for ``WATCHDOG=1`` more often than that; we ping at half of it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

from profagent.system.unixsock import parse_address, send_datagram

log = logging.getLogger(__name__)
SEND_TIMEOUT = 1.0  # seconds


class Notifier:
    """Sends notifications to systemd; every method is a no-op outside a notify unit."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = parse_address(address)
        self.watchdog_interval = watchdog_usec / 2e6 if watchdog_usec else None

    @classmethod
    def from_env(cls, env: Mapping[str, str], pid: int | None = None) -> Notifier:
        usec = env.get("WATCHDOG_USEC", "")
        owner = env.get("WATCHDOG_PID", "")
        mine = not owner or owner == str(os.getpid() if pid is None else pid)
        return cls(env.get("NOTIFY_SOCKET"), int(usec) if usec.isdigit() and mine else None)

    def send(self, *fields: str) -> bool:
        """Send ``KEY=VALUE`` fields as one datagram. False if not under systemd or it failed."""
        if self.address is None:
            return False
        try:
            # systemd's notify socket takes datagrams from anyone: a queue that others keep
            # full must not hold the watchdog thread, so a send waits at most a second
            send_datagram(self.address, "\n".join(fields).encode(), timeout=SEND_TIMEOUT)
            return True
        except OSError as exc:
            log.debug("sd_notify to %r failed: %s", self.address, exc)
            return False

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def reloading(self) -> bool:
        # MONOTONIC_USEC lets Type=notify-reload (systemd >= 253) match the reload; older
        # systemd ignores it.
        return self.send("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")

    def watchdog(self, status: str = "") -> bool:
        return self.send("WATCHDOG=1", *([f"STATUS={status}"] if status else []))

    def stopping(self) -> bool:
        return self.send("STOPPING=1")

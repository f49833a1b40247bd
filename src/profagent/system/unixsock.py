"""Every Unix socket of profagent: addresses (files and the abstract namespace), binding,
stale files, the control channel's JSON-line client, and closing what we bound.

An abstract address is written ``@name`` for people (systemd's NOTIFY_SOCKET does the same)
and ``\\0name`` for the kernel; a file address is a path.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Address = str | bytes  # a path, or b"\0name" in the abstract namespace


def abstract_address(name: str) -> bytes:
    """The kernel address of abstract socket ``name`` (every byte counts, trailing NULs too)."""
    return b"\0" + name.encode()


def parse_address(spec: str | None) -> Address | None:
    """``@name`` -> abstract, ``/path`` -> path; None for anything else (e.g. vsock:...)."""
    if not spec:
        return None
    if spec.startswith("@"):
        return abstract_address(spec[1:])
    if spec.startswith("\0"):
        return spec.encode()
    return spec if spec.startswith("/") else None


def describe_address(address: Address) -> str:
    """How people write ``address``: the path, or ``@name`` (trailing NULs dropped)."""
    if isinstance(address, bytes):
        return "@" + address[1:].rstrip(b"\0").decode(errors="replace")
    return address


@dataclass(frozen=True)
class Holder:
    """A process holding a socket: its PID and real uid."""

    pid: int
    uid: int


MAX_NET_UNIX_LINES = 200_000  # /proc/net/unix lines read when looking for a name's holder


def abstract_holders(address: bytes, proc_root: str = "/proc", deadline: float = 2.0,
                     clock: Callable[[], float] = time.monotonic) -> list[Holder] | None:
    """The processes holding a socket bound to the abstract ``address`` in our network
    namespace (/proc/net/unix names the socket, each process's fd links say whose it is).
    None when the look ran out of ``deadline`` seconds or could not read /proc/net/unix."""
    # /proc/net/unix writes the name with every NUL as "@"
    want = "@" + address[1:].decode(errors="replace").replace("\0", "@")
    end = clock() + deadline
    links: set[str] = set()
    try:
        with open(os.path.join(proc_root, "self/net/unix"), errors="replace") as fh:
            for n, line in enumerate(fh):
                if n > MAX_NET_UNIX_LINES:
                    return None
                parts = line.rstrip("\n").split(None, 7)
                if len(parts) == 8 and parts[7] == want:
                    links.add(f"socket:[{parts[6]}]")
    except OSError:
        return None
    holders: list[Holder] = []
    if not links:
        return holders
    try:
        pids = [int(e.name) for e in os.scandir(proc_root) if e.name.isdigit()]
    except OSError:
        return None
    for pid in pids:
        if clock() > end:
            return None
        folder = os.path.join(proc_root, str(pid), "fd")
        try:
            fds = os.listdir(folder)
            for fd in fds:
                with contextlib.suppress(OSError):
                    if os.readlink(os.path.join(folder, fd)) in links:
                        holders.append(Holder(pid, os.stat(os.path.join(proc_root, str(pid))).st_uid))
                        break
        except OSError:
            continue  # gone, or not ours to read
    return holders


def is_stale(path: str, kind: socket.SocketKind = socket.SOCK_STREAM) -> bool:
    """True if the socket file at ``path`` has nobody behind it (left by a crash)."""
    probe = socket.socket(socket.AF_UNIX, kind)
    try:
        probe.connect(path)
        return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        probe.close()


def bind_private(path: str, kind: socket.SocketKind = socket.SOCK_STREAM) -> socket.socket:
    """Bind a socket file only our user can connect to (0600 from the start: no window)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    sock = socket.socket(socket.AF_UNIX, kind)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old)
    return sock


def send_datagram(address: Address, payload: bytes, timeout: float | None = None) -> None:
    """One datagram to ``address``, waiting at most ``timeout`` seconds for room in the
    receiver's queue (None: as long as it takes). Raises OSError (TimeoutError included)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        sock.sendto(payload, address)


def close_unix_socket(sock: socket.socket | None, path: str | None) -> None:
    """Close a socket we bound and remove its file (our own file, never a user's)."""
    if sock is None:
        return
    sock.close()
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


def default_control_socket() -> str:
    """The agent's control socket: /run/profagent/control.sock as root (systemd
    RuntimeDirectory), else per user."""
    if os.geteuid() == 0:
        return "/run/profagent/control.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "profagent" if runtime else Path(f"/tmp/profagent-{os.geteuid()}")
    return str(base / "control.sock")


def call(path: str, request: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """One JSON request line to the agent's control socket at ``path``, one JSON reply line
    back. Raises OSError if nobody listens, or if the socket belongs to another user (who
    would then answer for the agent); ValueError on a reply that is not JSON."""
    owner = os.lstat(path).st_uid
    if owner not in (0, os.geteuid()):
        raise PermissionError(errno.EPERM, f"{path} belongs to uid {owner}, neither root nor us: not the agent's")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data or b"{}")

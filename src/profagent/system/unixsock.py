"""Unix sockets we own: close them and remove their file (never a file we did not bind)."""

from __future__ import annotations

import os
import socket


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

"""Opening paths other users can plant things in (``/tmp``, trace folders) without being fooled.

The agent often runs as root beside untrusted users. A path that already exists may be a
symlink to a private folder, a FIFO that blocks ``open()`` forever, or a file someone
else owns: never follow, never block, never chmod or chown what is not ours.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable
from pathlib import Path


class UnsafePath(Exception):
    """A path the agent refuses. ``reason``: symlink, not_regular, not_a_directory, foreign_owner."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def own_directory(path: str, mode: int) -> int:
    """Make ``path`` a real directory owned by us: created with ``mode`` if absent; an
    existing folder of ours is used as it is, its mode never changed (it may be /etc).
    Returns the folder's mode, so a caller can say when an existing one differs.

    Raises UnsafePath if it exists as a symlink, as something else than a directory, or
    owned by another user, OSError if it cannot be created.
    """
    created = True
    try:
        os.mkdir(path, 0o700)  # widened below, on the descriptor, once known to be ours
    except FileExistsError:
        created = False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        st = _lstat(path)
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise UnsafePath(f"{path!r} is a symbolic link (planted by another user?)", "symlink") from None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise UnsafePath(f"{path!r} exists and is not a directory", "not_a_directory") from None
        raise exc
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise UnsafePath(f"{path!r} already exists and belongs to uid {st.st_uid}, not to us (uid {os.geteuid()})",
                             "foreign_owner")
        if created and stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
            return mode
        return stat.S_IMODE(st.st_mode)
    finally:
        os.close(fd)


def open_regular(path: str, owner_ok: Callable[[int], bool] | None = None, exact: bool = False) -> int:
    """A descriptor on the regular file at ``path``, read-only, opened without following a
    symlink (in the last component) and without blocking on a FIFO or device.

    ``exact``: the file opened must be at ``path`` itself, no folder on the way a symlink
    (checked on the descriptor, so a folder swapped for a link after a scan is caught).

    Raises UnsafePath (symlink, not_regular, foreign_owner) or OSError.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        st = _lstat(path)
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise UnsafePath("a symbolic link: not followed", "symlink") from None
        raise exc
    try:
        if exact and _fd_path(fd) != os.path.abspath(path):
            raise UnsafePath("a folder on its path is a symbolic link: not followed", "symlink")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath("not a regular file (a FIFO, socket or device?)", "not_regular")
        if owner_ok is not None and not owner_ok(st.st_uid):
            raise UnsafePath(f"owned by uid {st.st_uid}, which neither the job nor the folder's owner is", "foreign_owner")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


# -- the agent's own files in its private folders (incident bundles, state) ---------------------
def write_nofollow(path: Path, data: bytes) -> None:
    """Create ``path`` 0600; fails rather than follow or overwrite anything planted there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def replace_nofollow(path: Path, data: bytes) -> None:
    """Write ``path`` atomically through a fresh temporary file in the same folder."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    write_nofollow(tmp, data)
    os.replace(tmp, path)


def read_nofollow(path: Path, limit: int = 16 * 1024 * 1024) -> bytes:
    """A regular file's bytes (never a symlink followed, never a FIFO waited on); OSError
    past ``limit`` bytes."""
    try:
        fd = open_regular(str(path))
    except UnsafePath as exc:
        raise OSError(f"{path}: {exc}") from None
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path}: more than {limit} bytes")
    return data

"""The one Unix-socket helper: address spelling, private binding, stale files."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

from profagent.system.unixsock import (
    abstract_address,
    bind_private,
    close_unix_socket,
    describe_address,
    is_stale,
    parse_address,
)


def test_abstract_names_are_spelled_with_at_for_people_and_nul_for_the_kernel() -> None:
    assert parse_address("@notify") == b"\0notify" == abstract_address("notify")
    assert parse_address("/run/systemd/notify") == "/run/systemd/notify"
    assert parse_address("vsock:2:9") is None and parse_address("") is None and parse_address(None) is None
    assert describe_address(abstract_address("dynolog\0")) == "@dynolog"  # Kineto's trailing NUL
    assert describe_address("/tmp/x.sock") == "/tmp/x.sock"


def test_bind_private_is_0600_and_close_removes_only_our_file(tmp_path: Path) -> None:
    path = str(tmp_path / "sub" / "control.sock")
    sock = bind_private(path)
    sock.listen(1)
    assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600
    assert not is_stale(path)
    close_unix_socket(sock, path)
    assert not Path(path).exists()


def test_a_socket_file_nobody_listens_on_is_stale(tmp_path: Path) -> None:
    path = str(tmp_path / "left.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.close()  # the file stays, as after a crash
    assert is_stale(path, socket.SOCK_DGRAM)
    assert not is_stale(str(tmp_path / "absent.sock"))  # no file: not ours to remove

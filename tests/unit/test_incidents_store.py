"""The incidents folder: 0700, no planted symlink followed, bounded with the oldest removed first;
the summary's "which line" from a real py-spy text dump layout; the stall fallback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from profagent.engine.incidents import (
    META,
    IncidentStore,
    innermost_frame,
    write_nofollow,
)


def add(store: IncidentStore, kind: str, t: float, size: int) -> Path:
    folder = store.create(kind, "job/1", t)
    write_nofollow(folder / META, json.dumps({"id": folder.name, "kind": kind, "job_id": "job/1", "time": t}).encode())
    write_nofollow(folder / "stacks-rank0.txt", b"x" * size)
    return folder


def test_folders_are_private_and_named_safely(tmp_path: Path) -> None:
    store = IncidentStore(tmp_path / "state" / "incidents")
    a = add(store, "hang", 1_700_000_000.0, 10)
    b = add(store, "hang", 1_700_000_000.0, 10)  # same second: a distinct folder
    assert a != b and a.parent == b.parent == store.root
    assert "/" not in a.name[len("20231114T221320Z-"):] and a.name.endswith("-hang")
    assert (store.root.stat().st_mode & 0o777) == 0o700 and (a.stat().st_mode & 0o777) == 0o700
    assert ((a / "stacks-rank0.txt").stat().st_mode & 0o777) == 0o600
    assert [m["id"] for m in store.list()] == sorted([a.name, b.name])


def test_planted_symlinks_are_never_followed(tmp_path: Path) -> None:
    store = IncidentStore(tmp_path / "incidents")
    folder = add(store, "hang", 1.0, 1)
    victim = tmp_path / "victim"
    victim.write_text("user data")
    os.symlink(victim, folder / "metrics.prom")
    with pytest.raises(OSError):
        write_nofollow(folder / "metrics.prom", b"overwritten?")
    assert victim.read_text() == "user data"
    os.symlink(tmp_path, store.root / "planted")  # a symlinked "incident" is neither listed nor removed
    assert [m["id"] for m in store.list()] == [folder.name]
    linked_root = tmp_path / "linked"
    os.symlink(tmp_path / "elsewhere", linked_root)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(OSError):
        IncidentStore(linked_root).ensure_root()


def test_prune_keeps_count_and_bytes_removing_the_oldest_first(tmp_path: Path) -> None:
    store = IncidentStore(tmp_path / "incidents")
    folders = [add(store, "hang", float(t), 1000) for t in (5, 1, 3, 4, 2)]
    assert sorted(store.prune(max_count=3, max_bytes=10**9)) == sorted(f.name for f in (folders[1], folders[4]))
    assert [m["time"] for m in store.list()] == [3.0, 4.0, 5.0]
    removed = store.prune(max_count=10, max_bytes=2500)  # each folder ~1.1 kB
    assert len(removed) == 1 and [m["time"] for m in store.list()] == [4.0, 5.0]
    assert not (store.root / removed[0]).exists()


DUMP = """Process 4242: /usr/bin/python3 train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 4243 (idle): "pt_autograd_0"
    wait (threading.py:320)
Thread 4242 (idle): "MainThread"
    clock_nanosleep (libc.so.6)
    time_sleep (libpython3.11.so.1.0)
    wait_while_hung (train.py:18)
    main (train.py:33)
    <module> (train.py:42)
"""


def test_innermost_python_frame_of_the_main_thread_skips_native_frames() -> None:
    assert innermost_frame(DUMP) == "wait_while_hung (train.py:18)"
    assert innermost_frame("") is None



"""The incidents folder: 0700, no planted symlink followed, bounded with the oldest removed first;
the summary's "which line" from a real py-spy text dump layout; the stall fallback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from profagent.analysis.incidents import Retention
from profagent.analysis.stacks import innermost_frame
from profagent.engine.incidents.bundle import META
from profagent.engine.incidents.store import IncidentStore, RateLimitFile
from profagent.engine.incidents.trigger import CaptureSlots
from profagent.system.safefs import write_nofollow


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
    assert [m.id for m in store.list()] == sorted([a.name, b.name])


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
    assert [m.id for m in store.list()] == [folder.name]
    linked_root = tmp_path / "linked"
    os.symlink(tmp_path / "elsewhere", linked_root)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(OSError):
        IncidentStore(linked_root).ensure_root()


def test_prune_keeps_count_and_bytes_removing_the_oldest_first(tmp_path: Path) -> None:
    store = IncidentStore(tmp_path / "incidents")
    folders = [add(store, "hang", float(t), 1000) for t in (5, 1, 3, 4, 2)]
    assert sorted(store.prune(Retention(max_count=3, max_bytes=10**9))) == sorted(f.name for f in (folders[1], folders[4]))
    assert [m.time for m in store.list()] == [3.0, 4.0, 5.0]
    removed = store.prune(Retention(max_count=10, max_bytes=2500))  # each folder ~1.1 kB
    assert len(removed) == 1 and [m.time for m in store.list()] == [4.0, 5.0]
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




# Captured from a real process (py-spy 0.4, Python 3.11): its main thread spins in
# ``spin`` (busy: "active+gil"), a second thread sleeps (idle). tests/e2e/test_incidents.py
# checks the same against a live py-spy dump.
BUSY_DUMP = """Process 8753: /work/wt/ddp-bundles/.venv/bin/python /tmp/busy_idle.py
Python v3.11.7 (/work/wt/ddp-bundles/.venv/bin/python)

Thread 8753 (active+gil): "MainThread"
    spin (busy_idle.py:8)
    <module> (busy_idle.py:9)
    0x7fc97fc4524a (libc.so.6)
Thread 8755 (idle): "idler"
    clock_nanosleep (libc.so.6)
    time_sleep (libpython3.11.so.1.0)
    idle (busy_idle.py:3)
    Thread.run (threading.py:982)
    Thread._bootstrap_inner (threading.py:1045)
    Thread._bootstrap (threading.py:1002)
    thread_run (libpython3.11.so.1.0)
"""


def test_a_busy_main_thread_keeps_its_line() -> None:
    """py-spy marks a running thread "(active+gil)" (or "(active)", "(gil)"): not only "(idle)"."""
    assert innermost_frame(BUSY_DUMP) == "spin (busy_idle.py:8)"
    idle_first = BUSY_DUMP.replace('(active+gil): "MainThread"', '(active): "MainThread"')
    assert innermost_frame(idle_first) == "spin (busy_idle.py:8)"


def add_for(store: IncidentStore, job: str, uid: int, t: float) -> Path:
    folder = store.create("hang", job, t)
    meta = {"id": folder.name, "kind": "hang", "job_id": job, "time": t, "uid": uid}
    write_nofollow(folder / META, json.dumps(meta).encode())
    return folder


def test_prune_lets_one_user_evict_only_its_own(tmp_path: Path) -> None:
    """Five jobs of uid 65534 capture one after the other; root's older bundle stays."""
    store = IncidentStore(tmp_path / "incidents")
    victim = add_for(store, "victim", 0, 1.0)
    for i in range(20):
        add_for(store, f"attacker{i % 5}", 65534, 2.0 + i)
        store.prune(Retention(max_count=6, max_bytes=10**9, max_count_per_job=2, max_count_per_user=4))
    kept = store.list()
    assert victim.name in [m.id for m in kept]
    assert sum(1 for m in kept if m.uid == 65534) == 4
    assert [m.time for m in kept if m.uid == 65534] == [18.0, 19.0, 20.0, 21.0]  # the newest of theirs


def test_rate_limits_survive_a_restart_and_a_corrupt_file_is_ignored(tmp_path: Path, caplog) -> None:
    path = tmp_path / "state" / "incidents-rate-limits.json"
    RateLimitFile(path).save({("hang", "job1"): 100.0, ("manual", "job2"): 50.0})
    assert (os.lstat(path).st_mode & 0o777) == 0o600
    assert RateLimitFile(path).load() == {("hang", "job1"): 100.0, ("manual", "job2"): 50.0}
    path.write_bytes(b"{not json")
    assert RateLimitFile(path).load() == {}
    assert sum("ignoring the incidents' rate-limit state" in r.getMessage() for r in caplog.records) == 1
    path.unlink()
    (tmp_path / "secret").write_text('{"last": [["hang", "x", 1.0]]}')
    path.symlink_to(tmp_path / "secret")  # a planted symlink is not followed, read or written through
    assert RateLimitFile(path).load() == {}
    RateLimitFile(path).save({("hang", "job1"): 1.0})
    assert not path.is_symlink() and (tmp_path / "secret").read_text() == '{"last": [["hang", "x", 1.0]]}'
    path.unlink()
    os.mkfifo(path)  # a FIFO is not waited on
    assert RateLimitFile(path).load() == {}
    assert RateLimitFile(tmp_path / "none.json").load() == {}


def test_capture_slots_are_per_job_and_per_user_within_a_global_cap() -> None:
    slots = CaptureSlots(total=3, per_user=1)
    assert slots.acquire("attacker1", 65534)
    assert not slots.acquire("attacker1", 65534)  # one per job
    assert not slots.acquire("attacker2", 65534)  # one per user
    assert slots.acquire("victim", 0)  # another user's is never blocked by it
    assert slots.acquire("third", 1000)
    assert not slots.acquire("fourth", 1001)  # the global cap
    slots.release("attacker1")
    assert slots.acquire("attacker2", 65534) and slots.running == 3


def test_bundle_meta_round_trips_and_reads_wrong_types_as_absent(tmp_path: Path) -> None:
    """incident.json is written and read by BundleMeta alone: every field it writes comes back
    (None fields are not written), and a value of the wrong type reads as absent."""
    from profagent.engine.incidents.bundle import BundleMeta

    store = IncidentStore(tmp_path)
    folder = store.create("hang", "job/1", 10.0)
    meta = BundleMeta(folder.name, "hang", "job/1", 10.0, "1", "rank 1 waits", 1000, "complete", completed=12.5,
                      updated=11.0, first_reason="rank 1 is stuck", files=["summary.md"], notes=["no trace"])
    write_nofollow(folder / META, meta.to_bytes())
    written = json.loads((folder / META).read_text())
    assert "path" not in written and written["notes"] == ["no trace"] and written["uid"] == 1000
    assert BundleMeta(folder.name).to_bytes() == json.dumps({"id": folder.name}, indent=2).encode() + b"\n"
    [read] = store.list()
    assert read == meta and read.path == str(folder)
    assert read.listed() == {"id": folder.name, "kind": "hang", "job_id": "job/1", "time": 10.0, "path": str(folder),
                             "rank": "1", "reason": "rank 1 waits", "status": "complete"}
    odd = BundleMeta.from_json({"id": "x", "time": "yesterday", "uid": True, "rank": 1, "files": "a", "status": "complete"})
    assert odd == BundleMeta("x", status="complete")
    assert BundleMeta.from_json({"time": 1.0}) is None and BundleMeta.from_json(["x"]) is None

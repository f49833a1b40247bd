"""Planted paths against a root agent: symlinks, FIFOs, other users' files and gzip bombs.

The attacker is a real unprivileged process (``setpriv`` to nobody) planting things in a
world-writable folder; the agent's sources must refuse them with one line and a reason,
leave everything outside their own files unchanged, and keep ingesting later traces.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import resource
import shutil
import stat
import subprocess
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.paths import shared_traces
from helpers.processes import wait_for
from profagent.contracts import ProcessInfo, ProcessTree
from profagent.errors import SourceUnavailable
from profagent.sources.ondemand.source import OndemandSource
from profagent.sources.traces import watcher as watcher_module
from profagent.sources.traces.reader import TraceError, read_trace
from profagent.sources.traces.source import TracesSource

SMALL = shared_traces() / "mi250-rocm.pt.trace.json.gz"
NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="plays a root agent against an unprivileged user: needs root and setpriv")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A world-writable sticky folder like /tmp (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="profagent-sec-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def small_for_nobody() -> Iterator[Path]:
    """A copy of SMALL that nobody can read: the checkout (and ../shared) may sit in a
    private folder, such as root's 0700 home, where nobody cannot reach it."""
    folder = Path(tempfile.mkdtemp(prefix="profagent-src-"))
    folder.chmod(0o755)
    copy = folder / SMALL.name
    shutil.copyfile(SMALL, copy)
    copy.chmod(0o644)
    yield copy
    shutil.rmtree(folder, ignore_errors=True)


def as_nobody(shared: Path, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (plain Python, no project imports) as nobody; fails the test if it fails."""
    script = shared / f"attacker-{time.monotonic_ns()}.py"
    script.write_text(textwrap.dedent(code))
    script.chmod(0o644)
    done = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           "/usr/bin/python3", str(script), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def _tree(*pids: int) -> ProcessTree:
    return ProcessTree("job1", pids[0] if pids else 1, tuple(
        ProcessInfo(pid, 1, 0.0, "main", str(i), str(i), str(len(pids)), "python3 train.py") for i, pid in enumerate(pids)
    ), alive=True)


class Running:
    """A started TracesSource plus a thread calling collect() like the runtime does."""

    def __init__(self, folder: Path, state: Path, tree: ProcessTree, **kw) -> None:
        kw.setdefault("settle_seconds", 0.3)
        self.source = TracesSource([folder], state, interval=0.1, **kw)
        self.tree = tree
        self.source.collect(tree)
        self.source.start()
        self.snapshot = self.source.collect(tree)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.source.interval):
            self.snapshot = self.source.collect(self.tree)

    def counts(self) -> dict[tuple[str, str], int]:
        return {(s, r): n for s, r, n in self.snapshot.counts if n}

    def stop(self) -> None:
        self._stop.set()
        self.source.stop()
        self._thread.join(2)


@pytest.fixture
def running(tmp_path: Path) -> Iterator:
    started: list[Running] = []

    def start(folder: Path, tree: ProcessTree | None = None, **kw) -> Running:
        # by default the job is this test process (root's): what root writes is the job's
        r = Running(folder, tmp_path / "state", tree or _tree(os.getpid()), **kw)
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


# -- 1. the on-demand folder -------------------------------------------------------------

def test_planted_symlink_or_folder_is_never_chmodded(shared: Path, tmp_path: Path) -> None:
    private = tmp_path / "root-only"
    private.mkdir(mode=0o700)
    (private / "secret.pt.trace.json").write_text('{"traceEvents": []}')
    as_nobody(shared, """
        import os, sys
        os.symlink(sys.argv[1], sys.argv[2] + "/ondemand-link")
        os.mkdir(sys.argv[2] + "/ondemand-dir", 0o777)
    """, str(private), str(shared))
    for name, words in (("ondemand-link", "symbolic link"), ("ondemand-dir", f"uid {NOBODY}")):
        source = OndemandSource(1.0, str(shared / name), socket_dir=str(tmp_path / "sock"))
        with pytest.raises(SourceUnavailable) as exc:
            source.start()
        assert words in str(exc.value) and "\n" not in str(exc.value)
    assert stat.S_IMODE(private.stat().st_mode) == 0o700  # the target was not touched
    planted = (shared / "ondemand-dir").stat()
    assert planted.st_uid == NOBODY and not planted.st_mode & stat.S_ISVTX  # not chmodded 1777

    fresh = shared / "fresh"  # absent: created as ours, world-writable and sticky
    source = OndemandSource(1.0, str(fresh), socket_dir=str(tmp_path / "sock"))
    source.start()
    try:
        st = os.lstat(fresh)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o1777
    finally:
        source.stop()


# -- 3, 7. FIFOs, symlinks and other users' files in a watched folder ----------------------

PLANT = """
    import os, shutil, sys
    folder, private_trace, small = sys.argv[1:4]
    os.mkfifo(folder + "/x.pt.trace.json")
    os.mkfifo(folder + "/fifo-target")
    os.symlink(folder + "/fifo-target", folder + "/via-link-to-fifo.pt.trace.json")
    os.symlink(private_trace, folder + "/y.pt.trace.json")
    shutil.copyfile(small, folder + "/mine.pt.trace.json.gz")
"""


def test_planted_fifo_symlink_and_foreign_file_are_refused(shared: Path, tmp_path: Path, running, caplog,
                                                           small_for_nobody: Path) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    private_trace = private / "p.pt.trace.json.gz"
    shutil.copyfile(SMALL, private_trace)
    private_trace.chmod(0o600)
    caplog.set_level(logging.WARNING)
    as_nobody(shared, PLANT, str(shared), str(private_trace), str(small_for_nobody))
    r = running(shared)
    wait_for(lambda: len(r.counts()) >= 3, 30, what="the planted files counted")
    shutil.copyfile(SMALL, shared / "real.pt.trace.json.gz")  # written by the job (root)
    wait_for(lambda: r.counts().get(("ingested", "ok")) == 1, 30, what="a valid trace after the planted ones")
    assert r.counts() == {
        ("ingested", "ok"): 1,
        ("skipped", "not_regular"): 1,
        ("skipped", "symlink"): 2,
        ("skipped", "foreign_owner"): 1,
    }
    assert r.source._thread.is_alive()
    lines = [rec.getMessage() for rec in caplog.records if "trace" in rec.getMessage() and "skipped" in rec.getMessage()]
    assert len(lines) == 4, lines
    assert len(r.snapshot.ranks) == 1  # only the real trace: nothing of the private one
    assert stat.S_IMODE(private_trace.stat().st_mode) == 0o600


def test_a_file_of_the_jobs_own_user_is_read(shared: Path, running, small_for_nobody: Path) -> None:
    """The owner check keeps real jobs working: a job running as nobody writes its trace."""
    job = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sleep", "120"])
    try:
        wait_for(lambda: os.stat(f"/proc/{job.pid}").st_uid == NOBODY, 10, what="the job running as nobody")
        r = running(shared, _tree(job.pid))
        as_nobody(shared, "import shutil, sys; shutil.copyfile(sys.argv[1], sys.argv[2])",
                  str(small_for_nobody), str(shared / "job.pt.trace.json.gz"))
        wait_for(lambda: r.counts().get(("ingested", "ok")) == 1, 30, what="the job's own trace ingested")
    finally:
        job.kill()
        job.wait()


def test_reader_never_blocks_on_a_fifo_or_follows_a_link(shared: Path) -> None:
    """The reader itself (the path is swapped after the watcher looked): no hang, a reason."""
    fifo = shared / "swap.pt.trace.json"
    os.mkfifo(fifo)
    link = shared / "link.pt.trace.json.gz"
    link.symlink_to(SMALL)
    outcome: list[str] = []

    def read_all() -> None:
        for path in (fifo, link):
            try:
                read_trace(path)
                outcome.append("read")
            except TraceError as exc:
                outcome.append(exc.reason)

    t = threading.Thread(target=read_all, daemon=True)
    t.start()
    t.join(60)  # generous: only a hang takes this long
    assert outcome == ["not_regular", "symlink"]


# -- 4. the inflated size cap --------------------------------------------------------------

def test_gzip_bomb_stops_at_the_cap(shared: Path, running) -> None:
    bomb = shared / "bomb.pt.trace.json.gz"
    cap = 16 * 1024 * 1024
    as_nobody(shared, """
        import gzip, sys
        with gzip.open(sys.argv[1], "wb", compresslevel=9) as fh:
            fh.write(b'{"traceEvents": [')
            block = b' ' * (1 << 20)
            for _ in range(512):  # 512 MiB once inflated, about 0.5 MiB on disk
                fh.write(block)
    """, str(bomb))
    os.chown(bomb, 0, 0)  # as if the job (root) wrote it: only the size may stop it
    assert bomb.stat().st_size < cap
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = running(shared, max_file_bytes=cap)
    wait_for(lambda: r.counts().get(("skipped", "too_large")) == 1, 120, what="the bomb refused as too_large")
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 200, f"reading the bomb grew the agent by {grown_mib:.0f} MiB"
    shutil.copyfile(SMALL, shared / "after.pt.trace.json.gz")
    wait_for(lambda: r.counts().get(("ingested", "ok")) == 1, 30, what="a valid trace after the bomb")


def test_cap_boundary_is_on_the_inflated_size(tmp_path: Path) -> None:
    text = gzip.decompress(SMALL.read_bytes())
    path = tmp_path / "t.pt.trace.json.gz"
    path.write_bytes(SMALL.read_bytes())
    assert len(read_trace(path, max_bytes=len(text))) > 0  # exactly the cap: read
    with pytest.raises(TraceError) as exc:
        read_trace(path, max_bytes=len(text) - 1)
    assert exc.value.reason == "too_large"


# -- 8. growing files, floods of tiny files ------------------------------------------------

def test_a_file_growing_forever_is_read_once_per_settle_period(shared: Path, running) -> None:
    attempts: list[float] = []

    def counting_reader(path: str):
        attempts.append(time.monotonic())
        return read_trace(path)

    grower = shared / "grow.json"
    grower.write_text('{"traceEvents": [{"ph": "X", "name": "k", "ts": 1, "dur": 1}')
    settle = 1.0
    r = running(shared, settle_seconds=settle, reader=counting_reader)
    began = time.monotonic()
    appends = 0
    with grower.open("a") as fh:
        while time.monotonic() - began < 4.0:  # every append ends in "}": looks complete
            fh.write(', {"ph": "X", "name": "k", "ts": 1, "dur": 1}' * 50)
            fh.flush()
            appends += 1
            time.sleep(0.02)
    elapsed = time.monotonic() - began
    wait_for(lambda: attempts, 10, what="the growing file attempted at least once")
    assert appends > 50
    assert len(attempts) <= elapsed / settle + 2, f"{len(attempts)} reads in {elapsed:.1f}s"
    del r


def test_ten_thousand_tiny_files_bound_logs_and_state_writes(shared: Path, running, caplog, monkeypatch) -> None:
    saves: list[int] = []
    real_save = watcher_module.Processed.save

    def counting_save(self) -> None:
        if self._unsaved:
            saves.append(1)
        real_save(self)

    monkeypatch.setattr(watcher_module.Processed, "save", counting_save)
    caplog.set_level(logging.WARNING)
    n = 2000
    as_nobody(shared, """
        import sys
        for i in range(int(sys.argv[2])):
            with open(f"{sys.argv[1]}/tiny{i}.json", "w") as fh:
                fh.write("{}")
    """, str(shared), str(n))
    for p in shared.glob("tiny*.json"):
        os.chown(p, 0, 0)  # the job's own files: counted not_a_trace, not refused as foreign
    began = time.monotonic()
    r = running(shared)
    wait_for(lambda: sum(r.counts().values()) >= n, 120, what="every tiny file counted")
    elapsed = time.monotonic() - began
    r.stop()
    warnings = [rec for rec in caplog.records if rec.levelno >= logging.WARNING and "tiny" in rec.getMessage()]
    assert len(warnings) <= 12, len(warnings)
    assert len(saves) <= elapsed / watcher_module.STATE_SAVE_EVERY + 3, (len(saves), elapsed)
    state = json.loads((r.source._watcher.processed.path).read_text())
    assert len(state["files"]) == n


def test_a_folder_swapped_for_a_symlink_is_not_followed(shared: Path, tmp_path: Path, running) -> None:
    """nobody makes a watched subfolder a link to root's private folder after the scan: the
    path the watcher was told of now leads to a root-owned trace outside the shared folder."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    shutil.copyfile(SMALL, private / "t.pt.trace.json.gz")
    as_nobody(shared, "import os, sys; os.symlink(sys.argv[1], sys.argv[2])", str(private), str(shared / "sub"))
    with pytest.raises(TraceError) as exc:  # the reader, as the agent calls it
        read_trace(shared / "sub" / "t.pt.trace.json.gz", owner_ok=lambda uid: True)
    assert exc.value.reason == "symlink"
    assert len(read_trace(shared / "sub" / "t.pt.trace.json.gz")) > 0  # a path given by hand may go through one
    r = running(shared)
    r.source._watcher.notify(str(shared / "sub" / "t.pt.trace.json.gz"))  # as if seen before the swap
    wait_for(lambda: r.counts().get(("skipped", "symlink")) == 1, 30, what="the swapped folder refused")
    assert r.snapshot.ranks == ()

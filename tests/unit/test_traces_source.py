"""The traces source and its watcher: completeness rules, statuses, restarts, rendering."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from helpers.agent import parse_metrics
from helpers.paths import shared_traces
from helpers.processes import wait_for
from helpers.prometheus import promtool_check_metrics
from profagent.contracts import ProcessInfo, ProcessTree, TracesSnapshot
from profagent.exporters.families import Families
from profagent.exporters.families.traces import render
from profagent.sources.traces.source import TracesSource, resolve_rank

NCCL = shared_traces() / "a100-2gpu-nccl.pt.trace.json.gz"
SMALL = shared_traces() / "mi250-rocm.pt.trace.json.gz"
TREE = ProcessTree("job1", 100, (
    ProcessInfo(100, 1, 0.0, "launcher", "", "", "", "torchrun"),
    ProcessInfo(4242, 100, 0.0, "main", "3", "3", "4", "python train.py"),
    ProcessInfo(4243, 100, 0.0, "main", "2", "2", "4", "python train.py"),
), alive=True)


class Running:
    """A started TracesSource plus a thread calling collect() like the runtime does."""

    def __init__(self, folder: Path, state: Path, **kw) -> None:
        kw.setdefault("settle_seconds", 0.3)
        kw.setdefault("invalid_after", 30.0)
        kw.setdefault("credentials", lambda pid: (0, frozenset()))  # TREE's made-up processes are root's
        self.source = TracesSource([folder], state, interval=0.1, **kw)
        self.source.start()
        self.snapshot: TracesSnapshot | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.source.interval):  # as the runtime ticks
            self.snapshot = self.source.collect(TREE)

    def counts(self) -> dict[tuple[str, str], int]:
        snap = self.snapshot
        return {} if snap is None else {(s, r): n for s, r, n in snap.counts if n}

    def total(self, status: str) -> int:
        return sum(n for (s, _), n in self.counts().items() if s == status)

    def prove_it_looked(self, folder: Path) -> None:
        """Drop one more good trace and wait until it is ingested and nothing is waiting.

        Files are handled in the order they appear, so once this newer file is counted the
        source has looked at every file written before it: a "nothing else changed" assertion
        made afterwards cannot pass just because the source was slow (the marker adds one
        ``("ingested", "ok")``)."""
        self._markers = getattr(self, "_markers", 0) + 1
        before = self.total("ingested")
        (folder / f"marker{self._markers}.pt.trace.json.gz").write_bytes(SMALL.read_bytes())
        wait_for(lambda: self.total("ingested") == before + 1 and self.snapshot.waiting == 0, 15,
                 what="the marker trace ingested and nothing waiting")

    def stop(self) -> None:
        self._stop.set()
        self.source.stop()
        self._thread.join(2)


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    folder, state = tmp_path / "traces", tmp_path / "state"
    folder.mkdir()
    return folder, state


@pytest.fixture
def running(dirs):
    started: list[Running] = []

    def start(**kw) -> Running:
        r = Running(*dirs, **kw)
        started.append(r)
        return r

    yield start
    for r in started:
        r.stop()


def _fingerprint(folder: Path) -> dict[str, tuple[int, int, str]]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p)] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def test_slow_gzip_writer_is_ingested_once_never_half(dirs, running) -> None:
    folder, _ = dirs
    data = gzip.decompress(NCCL.read_bytes())
    r = running()
    target = folder / "sub" / "rank0.pt.trace.json.gz"
    target.parent.mkdir()

    def writer() -> None:
        with gzip.open(target, "wb") as fh:
            step = len(data) // 20
            for i in range(0, len(data), step):
                fh.write(data[i : i + step])
                fh.flush()
                time.sleep(0.8 if i == 10 * step else 0.03)  # one pause longer than settle

    t = threading.Thread(target=writer)
    t.start()
    t.join(30)
    wait_for(lambda: r.total("ingested") == 1, 15, what="slow gzip ingested")
    (rank,) = r.snapshot.ranks
    assert rank.rank == "0" and len(rank.report.steps) == 3  # the whole trace, not a prefix
    r.prove_it_looked(folder)  # and the source still works
    assert r.counts() == {("ingested", "ok"): 2}  # the slow file once, plus the marker


def test_statuses_of_bad_files(dirs, running) -> None:
    folder, _ = dirs
    (folder / "corrupt.json").write_text('{"traceEvents": [{"ph": "X",, ]}')
    (folder / "empty.pt.trace.json").write_text('{"traceEvents": []}')
    (folder / "big.pt.trace.json.gz").write_bytes(NCCL.read_bytes())
    (folder / "cut.json").write_text('{"traceEvents": [{"ph": "X", "ts": 1')
    (folder / "x.pt.trace.json.tmp").write_text("{}")
    (folder / "notes.json").write_text('{"hello": 1}')
    r = running(max_file_bytes=100_000, invalid_after=1.5)
    expected = {("invalid", "corrupt"): 1, ("skipped", "empty"): 1, ("skipped", "too_large"): 1,
                ("invalid", "truncated"): 1, ("skipped", "not_a_trace"): 1}
    wait_for(lambda: r.counts() == expected, 15, what=f"statuses {expected}")
    assert r.snapshot.ranks == ()
    r.prove_it_looked(folder)  # the worker survived them
    # still working afterwards
    (folder / "ok.pt.trace.json.gz").write_bytes(SMALL.read_bytes())
    wait_for(lambda: r.total("ingested") == 1, 10, what="a good trace after bad ones")


def test_tmp_then_rename_and_files_untouched(dirs, running) -> None:
    folder, _ = dirs
    r = running()
    tmp = folder / "w.pt.trace.json.tmp"
    tmp.write_bytes(gzip.decompress(SMALL.read_bytes()))
    r.prove_it_looked(folder)
    assert r.counts() == {("ingested", "ok"): 1}  # the marker only: the .tmp file is not a trace yet
    before = _fingerprint(folder)
    os.replace(tmp, folder / "w.pt.trace.json")
    # complete -> visible: the bound is generous (a loaded machine); the settle rule is unit-tested
    wait_for(lambda: r.total("ingested") == 2, 30, what="renamed trace ingested")
    after = _fingerprint(folder)
    assert list(after.values()) == list(before.values())  # same bytes, size, mtime


def test_restart_does_not_count_twice(dirs, running) -> None:
    folder, state = dirs
    (folder / "a.pt.trace.json.gz").write_bytes(SMALL.read_bytes())
    (folder / "b.json").write_text("{not json}")
    first = running()
    wait_for(lambda: first.total("ingested") == 1 and first.total("invalid") == 1, 10, what="first pass")
    before = _fingerprint(folder)
    first.stop()
    assert (state / "traces-processed.json").exists()
    second = running()
    # a, b and corrupt were on disk before the marker: once the marker is counted, they were looked at
    second.prove_it_looked(folder)
    assert second.counts() == {("ingested", "ok"): 1}  # the marker only: nothing counted twice
    assert all(_fingerprint(folder)[k] == v for k, v in before.items())


def test_polling_fallback(dirs, running) -> None:
    folder, _ = dirs
    r = running(polling=True)
    (folder / "p.pt.trace.json.gz").write_bytes(SMALL.read_bytes())
    wait_for(lambda: r.total("ingested") == 1, 10, what="ingested while polling")


def test_rank_resolution() -> None:
    from profagent.analysis.trace.report import analyze
    from profagent.sources.traces.reader import read_trace

    with_rank = analyze(read_trace(NCCL))
    assert resolve_rank(with_rank, "x.json", TREE) == "0"  # distributedInfo wins
    rocm = analyze(read_trace(SMALL))  # no distributedInfo; pid 597913
    assert resolve_rank(rocm, "/t/host_1.123.pt.trace.json", TREE) == "unknown"
    assert resolve_rank(rocm, "/t/rank-7.json.gz", TREE) == "7"
    assert resolve_rank(rocm, "/t/host_4243.1700.pt.trace.json", TREE) == "2"
    mapped = ProcessTree("j", 1, (ProcessInfo(597913, 1, 0.0, "main", "5", "", "", "py"),), True)
    assert resolve_rank(rocm, "/t/anything.json", mapped) == "5"
    single = ProcessTree("j", 1, (ProcessInfo(1, 0, 0.0, "main", "0", "0", "1", "py"),), True)
    assert resolve_rank(rocm, "/t/anything.json", single) == "0"


def test_metrics_are_clean_and_bounded(dirs, running) -> None:
    folder, _ = dirs
    r = running(top_k=3)
    for name in ("a100-2gpu-nccl", "cpu-only-rank34", "v100-rank0"):
        (folder / f"{name}.pt.trace.json.gz").write_bytes((shared_traces() / f"{name}.pt.trace.json.gz").read_bytes())
    (folder / "bad.json").write_text("[")
    wait_for(lambda: r.total("ingested") == 3, 60, what="three traces")  # slow on a loaded node
    wait_for(lambda: r.total("invalid") == 1 or r.total("skipped") == 1 or r.snapshot.waiting, 5)
    out = Families()
    render(r.snapshot, out)

    class One:
        def collect(self):
            return iter(out)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(One())
    text = generate_latest(registry).decode()
    assert promtool_check_metrics(text) == ""
    m = parse_metrics(text)
    # rank 0 (v100 or nccl, whichever came last) and rank 34 (CPU only: no GPU series)
    ranks = {labels["rank"] for labels, _ in m["profagent_trace_step_seconds"]}
    assert ranks == {"0", "34"}
    assert {labels["rank"] for labels, _ in m["profagent_trace_gpu_idle_ratio"]} == {"0"}
    kernels = [labels for labels, _ in m["profagent_trace_top_kernel_seconds"] if labels["rank"] == "0"]
    assert len(kernels) == 4 and {"other"} <= {k["kernel"] for k in kernels}
    totals = {labels["status"]: v for labels, v in m["profagent_traces_total"]}
    assert totals["ingested"] == 3 and set(totals) == {"ingested", "invalid", "skipped"}
    ratios = [v for labels, v in m["profagent_trace_step_breakdown_ratio"] if labels["rank"] == "0"]
    assert len(ratios) == 8 and sum(ratios) == pytest.approx(1.0)
    assert json.dumps(r.snapshot.ranks[0].report.to_dict())  # JSON-able


def test_mutated_real_traces_each_end_in_a_status(dirs, running) -> None:
    import random

    folder, _ = dirs
    text = gzip.decompress(SMALL.read_bytes())
    rng = random.Random(5)
    for i in range(8):
        data = bytearray(text)
        for _ in range(rng.randint(1, 5)):
            pos = rng.randrange(len(data))
            data[pos : pos + rng.randint(0, 3)] = bytes(rng.randrange(256) for _ in range(rng.randint(0, 3)))
        if i % 2:
            data = data[: rng.randrange(1, len(data))]
        (folder / f"m{i}.pt.trace.json").write_bytes(bytes(data))
    r = running(invalid_after=1.0)
    wait_for(lambda: sum(r.counts().values()) == 8, 20, what="every mutated file counted once")
    r.prove_it_looked(folder)  # the source still works
    assert sum(r.counts().values()) == 9


def test_folder_created_later_is_watched(tmp_path: Path) -> None:
    later = tmp_path / "later" / "traces"
    r = Running(later, tmp_path / "state")
    try:
        wait_for(lambda: r.snapshot is not None, 10, what="the source running before the folder exists")
        later.mkdir(parents=True)
        (later / "x.pt.trace.json.gz").write_bytes(SMALL.read_bytes())
        wait_for(lambda: r.total("ingested") == 1, 10, what="trace in a folder created after start")
    finally:
        r.stop()


def test_traces_of_other_processes_are_skipped(dirs, running, caplog) -> None:
    """A shared folder (one agent per job): only the target's traces are ingested."""
    folder, _ = dirs
    text = gzip.decompress(SMALL.read_bytes()).decode()
    (folder / "profagent_aa_4243.json").write_text(text.replace('"pid": 597913', '"pid": 4243'))  # rank 2's
    (folder / "profagent_bb_999999.json").write_text(text)  # on-demand, from another job
    # a trace taken from a live process outside the job (this test process)
    (folder / "other.pt.trace.json").write_text(text.replace('"pid": 597913', f'"pid": {os.getpid()}'))
    (folder / "old.pt.trace.json").write_text(text)  # pid 597913: no such process here; kept
    import logging

    caplog.set_level(logging.DEBUG, "profagent.sources.traces.source")
    r = running()
    wait_for(lambda: r.total("ingested") + r.total("skipped") == 4, 20, what="four traces handled")
    assert r.counts() == {("ingested", "ok"): 2, ("skipped", "other_process"): 2}
    ranks = {rt.rank for rt in r.snapshot.ranks}
    assert ranks == {"2", "unknown"}  # pid 4243 is rank 2; the old trace has no rank
    infos = [rec for rec in caplog.records if rec.levelno == logging.INFO and "ingested" in rec.getMessage()]
    assert len(infos) == 1  # the first ingest at INFO, the next at DEBUG
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING]


def _two_jobs(job_id: str = "") -> ProcessTree:
    """Job A (pids 10, 11, user 1000) and job B (pid 20, user 2000); ``job_id`` "" is watch mode."""
    procs = (ProcessInfo(10, 1, 0.0, "main", "0", "0", "2", "python", job_id="A"),
             ProcessInfo(11, 1, 0.0, "main", "1", "1", "2", "python", job_id="A"),
             ProcessInfo(20, 1, 0.0, "main", "0", "0", "1", "python", job_id="B"))
    return ProcessTree(job_id, 10, procs if not job_id else procs[:2], alive=True)


CREDS = {10: (1000, frozenset({1000})), 11: (1000, frozenset({1000, 50})), 20: (2000, frozenset({2000}))}


@pytest.mark.parametrize(("name", "cpu_pids", "file_uid", "folder", "job_id", "strict", "want"), [
    ("host_10.1.pt.trace.json", (10,), 1000, "open", "", False, "A"),
    ("t.pt.trace.json", (10, 11), 0, "open", "", False, "A"),  # root's file: any job's
    ("t.pt.trace.json", (20,), 2000, "open", "", False, "B"),
    ("t.pt.trace.json", (10,), 2000, "open", "", False, "foreign_owner"),  # B's user naming A's PID
    ("t.pt.trace.json", (10, 20), 1000, "open", "", False, "other_process"),  # two jobs
    ("t.pt.trace.json", (10, 99999), 1000, "open", "", False, "other_process"),  # watch mode: every PID
    ("t.pt.trace.json", (), 1000, "open", "", False, "no_job_pid"),
    ("t.pt.trace.json", (99999,), 1000, "open", "A", False, "A"),  # attach, your folder, taken earlier
    ("t.pt.trace.json", (99999,), 1000, "open", "A", True, "other_process"),  # the on-demand folder
    ("t.pt.trace.json", (), 1000, "open", "A", True, "no_job_pid"),
    ("profagent_x_10.json", (10,), 1000, "open", "A", False, "A"),
    ("profagent_x_10.json", (99999,), 1000, "open", "A", False, "other_process"),  # another machine's rows
    ("profagent_x_99999.json", (99999,), 1000, "open", "A", False, "other_process"),
    ("t.pt.trace.json", (10,), 1000, "root_only", "", False, "foreign_folder"),
    ("t.pt.trace.json", (10,), 1000, "users", "", False, "A"),  # the user's own 0755 folder
    ("t.pt.trace.json", (11,), 1000, "group", "", False, "A"),  # group-writable, a group of the job
    ("t.pt.trace.json", (10,), 1000, "group", "", False, "foreign_folder"),  # not a group of PID 10
])
def test_attribution_by_kernel_credentials(tmp_path: Path, name: str, cpu_pids: tuple[int, ...], file_uid: int,
                                           folder: str, job_id: str, strict: bool, want: str) -> None:
    from types import SimpleNamespace

    from profagent.sources.traces.source import attribute

    modes = {"open": (0, 0, 0o1777), "root_only": (0, 0, 0o755), "users": (1000, 1000, 0o755), "group": (0, 50, 0o775)}
    uid, gid, mode = modes[folder]
    d = tmp_path / folder
    d.mkdir()
    if os.geteuid() != 0:
        pytest.skip("the folders of other users need root to make (chown)")
    os.chown(d, uid, gid)
    d.chmod(mode)
    found = attribute(SimpleNamespace(cpu_pids=cpu_pids), str(d / name), file_uid, _two_jobs(job_id),
                      alive=lambda pid: pid in CREDS, credentials=CREDS.get, strict=strict)
    assert (found.job_id or found.reason) == want, found


def test_a_gzip_appended_to_forever_is_read_a_few_times_then_counted_invalid(tmp_path: Path) -> None:
    """Issue 41 item 6 (the attack: a .json.gz appended to every 0.7 s kept the agent at ~60%
    of a core, re-inflated whole at each attempt). Clock injected: appended every 0.7 s for
    70 s, it is attempted at most 8 times (the wait doubles after each incomplete read: about
    log2(invalid_after / settle_seconds)), then counted invalid once invalid_after is over."""
    from profagent.sources.traces.watcher import FolderWatcher, Processed

    path = tmp_path / "forever.pt.trace.json.gz"
    path.write_bytes(gzip.compress(b'{"traceEvents": [')[:-8])  # a gzip stream that never ends
    watcher = FolderWatcher([tmp_path], Processed(None), settle_seconds=0.5, invalid_after=60.0,
                            max_file_bytes=2**30)
    attempts, final = 0, None
    for tick in range(700):  # 70 s, a look every 0.1 s
        now = tick * 0.1
        if tick % 7 == 0:
            with path.open("ab") as fh:
                fh.write(b"\0" * 16)
        watcher.notify(str(path))
        for verdict in watcher.due(now):
            if verdict.action == "attempt":
                attempts += 1
                watcher.failed(verdict, "truncated", "the gzip stream ends early")
            else:
                final = (now, verdict.action, verdict.reason)
        if final:
            break
    assert final is not None and final[1:] == ("invalid", "truncated") and 60.0 <= final[0] < 61.0
    assert 3 <= attempts <= 8, attempts


def test_an_incomplete_trace_stops_costing_once_its_reads_have_taken_the_cpu_budget(tmp_path: Path) -> None:
    """Issue 41 item 6: besides its deadline (invalid_after), a trace that stays incomplete
    gets a CPU budget over all its reads. Clock injected; each read is said to cost 0.4 s of
    CPU: the third read passes the 1 s budget, and the file is invalid (cpu_budget) at its
    next look, long before its 60 s deadline."""
    from profagent.sources.traces.watcher import FolderWatcher, Processed

    path = tmp_path / "forever.pt.trace.json.gz"
    path.write_bytes(gzip.compress(b'{"traceEvents": [')[:-8])
    watcher = FolderWatcher([tmp_path], Processed(None), settle_seconds=0.5, invalid_after=60.0,
                            max_file_bytes=2**30, incomplete_cpu=1.0)
    attempts, final = 0, None
    for tick in range(600):
        now = tick * 0.1
        if tick % 7 == 0:
            with path.open("ab") as fh:
                fh.write(b"\0" * 16)
        watcher.notify(str(path))
        for verdict in watcher.due(now):
            if verdict.action == "attempt":
                attempts += 1
                watcher.failed(verdict, "truncated", "the gzip stream ends early", cpu=0.4)
            else:
                final = (now, verdict.action, verdict.reason, verdict.message)
        if final:
            break
    assert attempts == 3
    assert final is not None and final[1:3] == ("invalid", "cpu_budget") and final[0] < 10.0, final
    assert "1.2 s of CPU over 3 reads (traces.incomplete_cpu_seconds = 1)" in final[3]
    for tick in range(100):  # its writer goes on: the path is neither read nor counted again
        with path.open("ab") as fh:
            fh.write(b"\0" * 16)
        watcher.notify(str(path))
        assert watcher.due(final[0] + 1 + tick * 0.7) == []
    assert watcher.waiting == 0


def test_a_trace_read_and_refused_is_not_read_again_as_its_writer_appends(tmp_path: Path) -> None:
    """A file read whole and refused (here as if over traces.max_events) then appended to
    every 0.7 s: each change would cost another whole read. Clock injected: one attempt,
    then nothing due for a minute of appends; an ingested file that changes is read again."""
    from profagent.sources.traces.watcher import FolderWatcher, Processed

    refused, good = tmp_path / "refused.json", tmp_path / "good.json"
    refused.write_text('{"traceEvents": []}')
    good.write_text('{"traceEvents": []}')
    watcher = FolderWatcher([tmp_path], Processed(None), settle_seconds=0.5, invalid_after=60.0,
                            max_file_bytes=2**30)
    read: list[str] = []
    for tick in range(900):  # 90 s, a look every 0.1 s
        now = tick * 0.1
        if tick % 7 == 0 and tick:
            with refused.open("a") as fh:
                fh.write(" ")
        if tick == 600:
            good.write_text('{"traceEvents": [] }')  # rewritten once: a new trace at that path
        for path in (refused, good):
            watcher.notify(str(path))
        for verdict in watcher.due(now):
            assert verdict.action == "attempt", verdict
            read.append(Path(verdict.path).name)
            watcher.finished(verdict, "skipped" if verdict.path == str(refused) else "ingested")
    assert read.count("refused.json") == 1 and read.count("good.json") == 2, read


def test_each_users_files_are_read_in_turn(tmp_path: Path) -> None:
    """Issue 41 item 6: 50 files of one user and one of another's are due at once; the
    round interleaves users (by each file's owner), so the other user's file is among the
    first two; a file the reader defers comes back in the next round, with nothing lost."""
    from profagent.sources.traces.watcher import FolderWatcher, Processed

    for i in range(50):
        (tmp_path / f"a{i:02d}.json").write_text("{}")
        if os.geteuid() == 0:
            os.chown(tmp_path / f"a{i:02d}.json", 65534, 65534)
    (tmp_path / "b.json").write_text("{}")
    watcher = FolderWatcher([tmp_path], Processed(None), settle_seconds=0.5, invalid_after=60.0,
                            max_file_bytes=2**30)
    watcher._owners |= {65534}  # both owners may write traces here
    for p in tmp_path.iterdir():
        watcher.notify(str(p))
    first = watcher.due(0.0)
    assert len(first) == 51 and all(v.action == "attempt" for v in first)
    if os.geteuid() == 0:
        assert "b.json" in [Path(v.path).name for v in first[:2]]
    for v in first[:10]:  # the reader's slice: 10 read, the rest deferred
        watcher.finished(v, "ingested")
    for v in first[10:]:
        watcher.defer(v)
    second = watcher.due(0.01)  # at once, not a settle period later
    assert sorted(v.path for v in second) == sorted(v.path for v in first[10:])

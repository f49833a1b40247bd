"""The timeline's library slots (sources/timeline/source.py), over a /proc tree of plain
files and stand-ins for tracefs and the rings: each user has timeline.max_libraries
slots, a library costs one until no observed process maps it, a file that gives no probe
costs none and is not read again, and the worker reads each user's files in turn."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.fake_libtorch import junk, probeable
from profagent.config import TimelineConfig
from profagent.contracts import ProcessInfo, ProcessTree
from profagent.sources.timeline import source as timeline
from profagent.sources.timeline.source import (
    RECHECK_AFTER,
    RECHECK_PROBED,
    UNMAPPED_GRACE,
    TimelineSource,
)

NOBODY = 65534


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


class Reader:
    """The rings' stand-in: which events are open."""

    def __init__(self) -> None:
        self.fds: dict[int, list[int]] = {}
        self.rings: dict[int, object] = {}
        self.losses: list[tuple[int, frozenset[int]]] = []
        self.lost = [0]

    def add(self, tp: int) -> None:
        self.fds[tp] = [tp]

    def remove(self, tp: int) -> None:
        self.fds.pop(tp, None)

    def drain(self, drop: frozenset[int] = frozenset()) -> list[tuple[int, int, int, int, bytes]]:
        return []  # no probe hits: these tests are about slots


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> dict[str, set[str]]:
    """uprobes.define and remove on a set of names, as tracefs would hold them."""
    defined: dict[str, set[str]] = {"names": set()}
    ids = iter(range(100, 100_000))

    def define(tracefs: Path, group: str, name: str, path: str, offset: int, fetchargs: str = "") -> int:
        assert os.path.isfile(path) and name not in defined["names"]
        defined["names"].add(name)
        return next(ids)

    def remove(tracefs: Path, group: str, name: str) -> bool:
        defined["names"].discard(name)
        return True

    monkeypatch.setattr(timeline.uprobes, "define", define)
    monkeypatch.setattr(timeline.uprobes, "remove", remove)
    return defined


def _process(proc: Path, pid: int, uid: int, files: list[bytes]) -> None:
    """A process of ``uid`` mapping each of ``files`` executable under libtorch's name."""
    (proc / str(pid) / "map_files").mkdir(parents=True)
    lines = []
    for i, data in enumerate(files):
        span = f"{0x7f0000000000 + i * 0x10000:x}-{0x7f0000000000 + i * 0x10000 + 0x1000:x}"
        path = proc / str(pid) / "map_files" / span
        path.write_bytes(data)
        lines.append(f"{span} r-xp 00000000 fe:00 {os.stat(path).st_ino}    /venv{pid}-{i}/lib/libtorch_cpu.so")
    (proc / str(pid) / "maps").write_text("\n".join(lines) + "\n")
    os.chown(proc / str(pid), uid, uid)


def _tree(*pids: int) -> ProcessTree:
    return ProcessTree("", 1, tuple(ProcessInfo(pid, 1, 0.0, "main", "0", "0", "1", "train", job_id=f"job{pid}")
                                    for pid in pids), True)


def _tick(source: TimelineSource, clock: Clock, tree: ProcessTree) -> None:
    """A collect, the worker until idle, and the collect that places what it read."""
    clock.t += RECHECK_AFTER
    source.collect(tree)
    while source._work_once():
        pass
    source.collect(tree)


def test_slots_are_per_user_freed_when_unmapped_and_junk_costs_none(tmp_path: Path, kernel: dict,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    proc = tmp_path / "proc"
    # nobody: 3 junk files, then 10 libraries that give probes; root: one library
    _process(proc, 100, NOBODY, [junk(i) for i in range(3)] + [probeable(i) for i in range(10)])
    _process(proc, 200, 0, [probeable(99)])
    reads: list[str] = []
    read_file = TimelineSource._read_file
    monkeypatch.setattr(TimelineSource, "_read_file", lambda self, f: reads.append(f.path) or read_file(self, f))
    clock = Clock()
    source = TimelineSource(TimelineConfig(max_libraries=8), interval=0.5, proc_root=proc, clock=clock)
    source._tracefs, source._group, source._reader = tmp_path, "profagent_test", Reader()  # type: ignore[assignment]

    both = _tree(100, 200)
    for _ in range(4):
        _tick(source, clock, both)
    users = sorted(p.uid for p in source._placed.values())
    assert users == [0] + [NOBODY] * 8  # root's library placed whatever nobody maps
    assert len(kernel["names"]) == 9 * 2 and len(source._reader.fds) == 18  # rf_enter and rf_exit each
    junk_paths = [f"/venv100-{i}/lib/libtorch_cpu.so" for i in range(3)]
    assert sorted(p for p in reads if p in junk_paths) == junk_paths  # read, each once, and remembered
    assert len(reads) == len(set(reads))  # no file read twice

    # nobody's process leaves: once UNMAPPED_GRACE has passed, its eight libraries' probes
    # come off; root's stay
    only_root = _tree(200)
    _tick(source, clock, only_root)
    assert len(source._placed) == 9  # not at once: a rank between two of its looks
    clock.t += UNMAPPED_GRACE
    _tick(source, clock, only_root)
    while source._work_once():
        pass
    assert [p.uid for p in source._placed.values()] == [0]
    assert len(kernel["names"]) == 2 and len(source._reader.fds) == 2
    assert [lib.path for lib in source.collect(only_root).libraries] == ["/venv200-0/lib/libtorch_cpu.so"]


def test_a_rank_whose_every_libtorch_is_probed_has_its_maps_read_once_a_minute(tmp_path: Path, kernel: dict,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a torch process's maps takes milliseconds: a rank whose every libtorch is
    probed or gave none (libtorch.so's shim) is looked at again each RECHECK_PROBED seconds
    (for a library it maps later), one with a file waiting (past its user's slots) each
    RECHECK_AFTER."""
    proc = tmp_path / "proc"
    _process(proc, 100, NOBODY, [probeable(i) for i in range(3)])  # one more than its slots
    _process(proc, 200, 0, [probeable(99), junk(7)])  # junk: as libtorch.so's shim, no probe
    looks: list[int] = []
    libraries = timeline._libraries
    monkeypatch.setattr(timeline, "_libraries", lambda root, pid: looks.append(pid) or libraries(root, pid))
    clock = Clock()
    source = TimelineSource(TimelineConfig(max_libraries=2), interval=0.5, proc_root=proc, clock=clock)
    source._tracefs, source._group, source._reader = tmp_path, "profagent_test", Reader()  # type: ignore[assignment]
    both = _tree(100, 200)
    _tick(source, clock, both)
    _tick(source, clock, both)  # root's library placed at the first tick's second collect: seen so here
    assert sorted(p.uid for p in source._placed.values()) == [0, NOBODY, NOBODY]
    looks.clear()
    ticks = int(RECHECK_PROBED // RECHECK_AFTER) - 1
    for _ in range(ticks):
        _tick(source, clock, both)
    assert looks.count(100) == ticks and looks.count(200) == 0
    _tick(source, clock, both)
    assert looks.count(200) == 1


"""The rules for the ways a real job stops, on real py-spy output of
tests/workloads/failmodes.py (tests/unit/fixtures/failmodes/README.md): where a stack stands
still, the rank's own line, a spinning culprit, a hung DataLoader worker, uneven inputs,
and the advice every finding carries."""

from __future__ import annotations

import dataclasses
import io
import logging
from pathlib import Path

from rich.console import Console

from profagent.analysis.collectives import collective_wait, moving, parse_dump_text
from profagent.analysis.findings.bound import bound
from profagent.analysis.findings.hang import hang, held_up_ranks
from profagent.analysis.findings.inputs import RankShares
from profagent.analysis.stacks import (
    CATEGORIES,
    Frame,
    Sample,
    StallTracker,
    classify,
    fetching,
    innermost_python,
    own_frame,
    parse_folded,
    parse_frame,
    standing_key,
    waits_on_dataloader,
)
from profagent.cli.diagnose import render
from profagent.config import FindingsConfig
from profagent.contracts import Finding, RankStall, WorkerStall
from profagent.engine.incidents.summary import own_line
from profagent.logs import PrintableFormatter

FIXTURES = Path(__file__).parent / "fixtures" / "failmodes"


def dump_main(name: str) -> tuple[Frame, ...]:
    threads = parse_dump_text((FIXTURES / name).read_text())
    return next(t for t in threads if t.name == "MainThread").frames


def raw_main(name: str) -> list[Sample]:
    text = (FIXTURES / name).read_text()
    pid = int(text.split("thread (", 1)[1].split(")", 1)[0]) if "MainThread" not in text else 0
    return [s for s in parse_folded(text, pid) if s.main]


# -- where a stack stands still, and the rank's own line ---------------------------------------

def test_dataloader_wait_stands_still_by_its_own_line_not_its_innermost_c_frame() -> None:
    native = dump_main("dataloader_wait_rank0_native.txt")
    [plain] = raw_main("dataloader_wait_rank0.raw")
    # py-spy --native names a C frame of the interpreter with a file and line: not a Python frame
    assert str(innermost_python(native)) == "_PollLikeSelector.select (selectors.py:415)"
    assert any(f.file == "selectmodule.c" for f in native)
    assert str(own_frame(native)) == str(own_frame(plain.frames)) == "main (failmodes.py:113)"
    # the same wait, with or without native frames, and when the poll loop wakes (its 5 s
    # timeout) at another line of the DataLoader: one standing key
    woke = (*plain.frames[:5], parse_frame("_MultiProcessingDataLoaderIter._get_data (torch/utils/data/dataloader.py:1470)"))
    assert standing_key(native) == standing_key(plain.frames) == standing_key(woke)
    assert standing_key(plain.frames).endswith("_BaseDataLoaderIter.__next__ (torch/utils/data/dataloader.py:725)")
    assert waits_on_dataloader(plain.frames) and not waits_on_dataloader(dump_main("uneven_barrier_rank0_native.txt"))


def test_stall_tracker_stalls_a_wait_whose_innermost_frames_flip() -> None:
    [plain] = raw_main("dataloader_wait_rank0.raw")
    flipped = dataclasses.replace(plain, frames=dump_main("dataloader_wait_rank0_native.txt"),
                                  folded="native")
    tracker = StallTracker(stall_seconds=10.0)
    statuses = [tracker.update([plain if i % 2 else flipped], i * 2.0, i * 2.0 + 2.0, None) for i in range(7)]
    assert [s.stalled for s in statuses] == [False] * 5 + [True, True]
    assert statuses[-1].unchanged_seconds == 14.0


def test_a_loop_spinning_at_one_line_stands_still_and_a_training_loop_does_not() -> None:
    [spin] = raw_main("spin_rank1_native.raw")
    python = dataclasses.replace(spin, frames=tuple(f for f in spin.frames if f.file))
    tracker = StallTracker(stall_seconds=5.0)
    # windows with and without native frames (the interpreter's, libc's) of the same line
    windows = [[spin], [python], [spin, python]]
    assert [tracker.update(w, t, t + 2.0, None).stalled for w, t in zip(windows, (0.0, 2.0, 4.0), strict=True)] \
        == [False, False, True]
    # a loop of torch calls in one function shows only its lines, and moves between them
    base = ("<module> (train.py:131)",)
    steps = [Sample("MainThread", True, tuple(map(parse_frame, (*base, f"main (train.py:{n})"))), 10, str(n))
             for n in (118, 119)]
    healthy = StallTracker(stall_seconds=5.0)
    assert not any(healthy.update(steps, t, t + 2.0, None).stalled for t in (0.0, 2.0, 4.0, 6.0))


def test_a_spinning_rank_is_not_moving_a_computing_one_is() -> None:
    spin = raw_main("spin_rank1_native.raw")
    assert spin and not moving(spin, spin[0].frames)
    # the interpreter's own frames changing under the spinning line do not make it move
    interp = [dataclasses.replace(spin[0], frames=(*spin[0].frames, Frame(f"{fn} (libpython3.11.so.1.0)", "", 0)),
                                  folded=fn) for fn in ("_PyEval_EvalFrameDefault", "PyNumber_Add")]
    assert not moving(interp, interp[0].frames)
    # a C++ call computing under one Python line does (a slow backward)
    computing = [dataclasses.replace(spin[0], frames=(*spin[0].frames, Frame(f"{fn} (libtorch_cpu.so)", "", 0)),
                                     folded=fn) for fn in ("at::native::addmm", "mkl_sgemm")]
    assert moving(computing, computing[0].frames)


def test_worker_frames_say_whether_it_makes_a_batch() -> None:
    hung, idle = dump_main("dataloader_worker_hung.txt"), dump_main("dataloader_worker_idle.txt")
    assert fetching(hung) and not fetching(idle)
    assert str(own_frame(hung)) == "SyntheticImages.__getitem__ (failmodes.py:75)"
    [window] = raw_main("dataloader_worker_hung.raw")
    assert standing_key(window.frames) == standing_key(hung)


# -- hang: a hung worker, uneven inputs, a spinning culprit -------------------------------------

def victim(name: str, seconds: float = 30.0) -> RankStall:
    native = dump_main(name)
    python = tuple(f for f in native if f.file and not f.file.endswith(".c"))
    return RankStall("1", True, seconds, "job", python, native=native)


def test_hung_worker_is_named_with_its_pid_and_line_and_the_rank_its_own() -> None:
    wait = dump_main("dataloader_wait_rank0_native.txt")
    worker = WorkerStall(16276, True, 28.0, dump_main("dataloader_worker_hung.txt"))
    idle = WorkerStall(16274, False, 28.0, dump_main("dataloader_worker_idle.txt"))
    rank0 = RankStall("0", True, 30.0, "job", wait, native=wait, workers=(idle, worker))
    rank1 = victim("spin_victim_rank0_native.txt")
    [f] = hang([rank0, rank1], "job")
    assert f.rank == "0" and f.evidence["culprit_ranks"] == ["0"] and f.evidence["waiting_ranks"] == ["1"]
    assert ("rank 0 at main (failmodes.py:113), waiting for its DataLoader: its DataLoader worker PID 16276 "
            "stands still at SyntheticImages.__getitem__ (failmodes.py:75) for 28 s") in f.summary, f.summary
    assert "select" not in f.summary
    assert f.evidence["roles"]["0"]["innermost"] == "_PollLikeSelector.select (selectors.py:415)"
    assert [w["pid"] for w in f.evidence["dataloader_workers"]["0"] if w["stuck"]] == [16276]
    assert "DataLoader(timeout" in f.advice and "more workers do not help" in f.advice
    # its workers' first windows not back yet: the first verdict waits for them
    pending = dataclasses.replace(rank0, workers=(), workers_pending=True)
    assert hang([pending, rank1], "job") == []
    assert held_up_ranks([pending]) == {("job", "0")} and held_up_ranks([rank0]) == {("job", "0")}


def test_uneven_inputs_barrier_against_backward() -> None:
    barrier = dump_main("uneven_barrier_rank0_native.txt")
    rank0 = RankStall("0", True, 30.0, "job", tuple(f for f in barrier if f.file), native=barrier)
    rank1 = victim("uneven_backward_rank1_native.txt")
    assert collective_wait(barrier).collective == "barrier"
    [f] = hang([rank0, rank1], "job")
    assert f.evidence["diagnosis"] == "uneven_inputs" and f.rank is None
    assert f.summary == (
        "uneven inputs for 30 s: rank 0 finished its data early and waits at the end of its loop (rank 0 waits in "
        "barrier at main (failmodes.py:126)) while rank 1 still trains, waiting in all_reduce from backward "
        "(rank 1 at main (failmodes.py:120)): make every rank see the same number of batches (DistributedSampler, "
        "drop_last) or use DDP's join() (torch.distributed.algorithms.Join)")
    assert f.evidence["diagnosis_ranks"] == {"finished": ["0"], "training": ["1"]}
    assert "join()" in f.advice
    # an all_reduce in the loop against a broadcast stays a collective mismatch, with its advice
    bcast = (parse_frame("<module> (t.py:1)"), parse_frame("main (t.py:5)"),
             parse_frame("broadcast (torch/distributed/distributed_c10d.py:2700)"))
    [m] = hang([dataclasses.replace(rank0, frames=bcast, native=()), rank1], "job")
    assert m.evidence["diagnosis"] == "collective_mismatch" and "same order" in m.advice


def test_spinning_culprit_stalled_in_the_evidence() -> None:
    [spin] = raw_main("spin_rank1_native.raw")
    python = tuple(f for f in spin.frames if f.file)
    rank1 = RankStall("1", True, 20.0, "job", python, native=spin.frames)
    rank0 = dataclasses.replace(victim("spin_victim_rank0_native.txt"), rank="0")
    [f] = hang([rank0, rank1], "job")
    assert f.rank == "1" and f.evidence["roles"]["1"]["stalled"] is True and "1" in f.evidence["stalled_ranks"]
    assert "rank 1 at spin_forever (failmodes.py:91)" in f.summary and f.advice


# -- dataloader_bound while a worker hangs; advice everywhere ---------------------------------

def test_no_dataloader_bound_while_a_worker_hangs() -> None:
    cfg = FindingsConfig(min_samples=10)
    counts = {c: 0 for c in CATEGORIES} | {"dataloader": 90, "forward": 10}
    shares = [RankShares("job", "0", counts, 100.0)]
    [f] = bound(shares, [], cfg)
    assert f.finding == "dataloader_bound" and "more DataLoader workers" in f.advice
    assert bound(shares, [], cfg, {("job", "0")}) == []


def test_every_finding_says_what_to_do_in_the_api_and_diagnose() -> None:
    f = Finding("hang", "job", "0", "critical", "rank 0 is stuck", {}, 1.0, advice="look at line 3")
    assert f.as_dict()["advice"] == "look at line 3"
    out = io.StringIO()
    render({"findings": [f.as_dict()], "time": 2.0}, Console(file=out, width=200, color_system=None))
    assert "what to do: look at line 3" in out.getvalue()


def test_bundle_own_line_from_a_dump() -> None:
    text = (FIXTURES / "dataloader_wait_rank0_native.txt").read_text()
    assert own_line(text) == "main (failmodes.py:113)"
    assert own_line((FIXTURES / "dataloader_worker_hung.txt").read_text()) == "SyntheticImages.__getitem__ (failmodes.py:75)"


def test_log_records_keep_a_stack_one_escaped_frame_a_line() -> None:
    record = logging.LogRecord("x", logging.WARNING, "f", 1, "rank %s stalled; stack:", ("0",), None)
    record.lines = ["main (train.py:3)", "evil\nprofagent ERROR: forged (x.py:1)"]
    text = PrintableFormatter("profagent %(levelname)s: %(message)s").format(record)
    assert text.splitlines() == ["profagent WARNING: rank 0 stalled; stack:", "    main (train.py:3)",
                                 "    evil\\x0aprofagent ERROR: forged (x.py:1)"]


def test_fsdp2_hooks_and_dynamo_disable_are_not_compile() -> None:
    samples = [s for s in parse_folded((FIXTURES / "fsdp2_healthy_rank1.raw").read_text(), 0) if "MainThread" in s.folded]
    disabled = [s for s in samples if any(f.file.endswith("torch/_dynamo/decorators.py") for f in s.frames)]
    assert disabled, "the fixture has samples in torch._dynamo.disable"
    assert {classify(s.frames) for s in disabled} <= {"collective", "forward", "backward"}
    assert not [s for s in samples if classify(s.frames) == "compile"]
    # so an FSDP2 rank's windows are steady: its native windows teach its wait ratios, and
    # it is judged (profagent_collective_wait_ratio) like a DDP rank
    from profagent.sources.stacks.source import _steady
    assert _steady(samples)
    # a real compilation still is
    compiling = (parse_frame("main (t.py:3)"), parse_frame("_fn (torch/_dynamo/eval_frame.py:600)"),
                 parse_frame("_compile (torch/_dynamo/convert_frame.py:900)"))
    assert classify(compiling) == "compile"


def test_banner_wraps_at_words_on_a_terminal_and_stays_one_line_elsewhere() -> None:
    from profagent.engine.agent import BANNER_INDENT, banner_line

    words = ("  source stacks: [yellow]off[/yellow]: ptrace denied on PID 4242, so py-spy cannot read its "
             "stacks: run as root or set kernel.yama.ptrace_scope to 0")
    plain = words.replace("[yellow]", "").replace("[/yellow]", "")
    out = io.StringIO()
    banner_line(Console(file=out, width=40, force_terminal=True, color_system=None), words)
    lines = out.getvalue().splitlines()
    assert len(lines) > 2 and all(len(x) <= 40 for x in lines), lines
    assert all(x.startswith(" " * BANNER_INDENT) for x in lines[1:]), lines
    assert " ".join(x.strip() for x in lines) == " ".join(plain.split())  # every word whole, none split
    log = io.StringIO()
    banner_line(Console(file=log, width=40, force_terminal=False, color_system=None), words)
    assert log.getvalue() == plain + "\n"


# -- the stacks source: a waiting rank's workers are sampled, the stuck one named ---------------

class FakeSampler:
    def request_native(self, pid: int) -> None:
        pass


def test_stacks_source_samples_a_waiting_ranks_workers_and_names_the_stuck_one(tmp_path: Path) -> None:
    from profagent.config import StacksConfig
    from profagent.contracts import ProcessInfo, ProcessTree
    from profagent.sources.stacks.sampler import Result
    from profagent.sources.stacks.source import StacksSource

    now = [0.0]
    src = StacksSource(StacksConfig(window=2, stall_seconds=10.0, native=False), clock=lambda: now[0],
                       wall=lambda: now[0], proc_root=str(tmp_path))
    src._sampler = FakeSampler()  # type: ignore[assignment]

    def proc(pid: int, role: str, rank: str) -> ProcessInfo:
        return ProcessInfo(pid, 1, 0.0, role, rank, rank, "2", "python train.py", "job")

    tree = ProcessTree("job", 1, (proc(100, "main", "0"), proc(101, "dataloader", "0"), proc(102, "dataloader", "0"),
                                  proc(200, "main", "1")), True)
    [wait] = raw_main("dataloader_wait_rank0.raw")
    [hung] = raw_main("dataloader_worker_hung.raw")
    idle = Sample("MainThread", True, dump_main("dataloader_worker_idle.txt"), 100, "idle")

    def window(pid: int, role: str, samples: list[Sample]) -> None:
        src._fold(Result("record", pid, "0", role, now[0] - 2.0, now[0], now[0], samples=tuple(samples)))

    assert set(src._targets(tree)) == {100, 200}  # stacks.dataloader is off: workers not sampled yet
    now[0] = 2.0
    window(100, "main", [wait])
    assert set(src._targets(tree)) == {100, 101, 102, 200}  # rank 0 waits for its DataLoader
    [stall] = src._snapshot("job").stalls
    assert stall.workers_pending and not stall.workers
    assert held_up_ranks([stall]) == {("job", "0")}
    for _ in range(7):
        now[0] += 2.0
        window(100, "main", [wait])
        window(101, "dataloader", [hung])
        window(102, "dataloader", [idle])
        src._targets(tree)
    [stall] = src._snapshot("job").stalls
    assert stall.stalled and not stall.workers_pending
    assert [(w.pid, w.stuck) for w in stall.workers] == [(101, True), (102, False)]
    assert stall.stuck_workers[0].unchanged_seconds == 14.0
    assert str(own_frame(stall.stuck_workers[0].frames)) == "SyntheticImages.__getitem__ (failmodes.py:75)"
    # /api/stacks holds the workers' windows too
    assert "dataloader worker;" in src.folded("0", 60.0, "job")

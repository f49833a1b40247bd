"""The collective-layer frame patterns (analysis/collectives.py), each on real py-spy
--native output of gloo DDP / FSDP2 ranks (tests/unit/fixtures/native/README.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from profagent.analysis.collectives import (
    NATIVE_PATTERNS,
    WaitRatios,
    collective_wait,
    frames_from_json,
    moving,
    native_pattern,
    native_waits,
    parse_dump_text,
    python_only,
)
from profagent.analysis.stacks import classify, parse_folded
from profagent.contracts import Frame

FIXTURES = Path(__file__).parent / "fixtures" / "native"


def main_frames(name: str) -> tuple[Frame, ...]:
    threads = parse_dump_text((FIXTURES / name).read_text())
    return next(t for t in threads if t.name == "MainThread").frames


def raw_main(name: str, pid: int) -> list:
    return [s for s in parse_folded((FIXTURES / name).read_text(), pid) if s.main]


def test_dump_text_parses_threads_states_and_native_frames() -> None:
    [thread] = parse_dump_text((FIXTURES / "ddp_reducer_finalize_backward.txt").read_text())
    assert (thread.tid, thread.name, thread.state) == ("12077", "MainThread", "idle")
    assert str(thread.frames[0]) == "0x7fa3b0e4524a (libc.so.6)"  # root first
    assert str(thread.frames[1]) == "<module> (plain_ddp.py:103)"
    assert "_engine_run_backward (torch/autograd/graph.py:979)" in [str(f) for f in thread.frames]
    assert thread.frames[-1] == Frame("0x7fa3b0ea3f16 (libc.so.6)", "", 0)  # innermost last
    active = parse_dump_text('Thread 7 (active+gil): "MainThread"\n    f (x.py:3)\n')
    assert active[0].state == "active+gil" and str(active[0].frames[0]) == "f (x.py:3)"


def test_ddp_reducer_in_backward_is_a_collective_wait_python_alone_cannot_tell() -> None:
    frames = main_frames("ddp_reducer_finalize_backward.txt")
    python = tuple(f for f in frames if f.file)
    assert collective_wait(python) is None and classify(python) == "backward"
    wait = collective_wait(frames)
    assert wait is not None and wait.native
    assert wait.collective == "all_reduce from backward (DDP's reducer)"
    assert wait.frame.name == "c10d::Reducer::finalize_backward (libtorch_cpu.so)"
    assert str(wait.called_at) == "main (plain_ddp.py:95)"


def test_the_culprit_asleep_before_its_forward_is_in_no_collective() -> None:
    frames = main_frames("ddp_culprit_sleep_before_forward.txt")
    assert collective_wait(frames) is None
    assert str([f for f in frames if f.file][-1]) == "main (plain_ddp.py:85)"


@pytest.mark.parametrize(("fixture", "collective", "line"), [
    ("work_wait_all_reduce.txt", "all_reduce", "plain_ddp.py:90"),
    ("work_wait_broadcast.txt", "broadcast", "plain_ddp.py:93"),
    ("fsdp2_all_gather_in_forward.txt", "all_gather_single", "plain_ddp.py:49"),  # the layer call in forward
    ("fsdp2_all_gather_in_backward_hook.txt", "all_gather_single from backward", "extra.py:22"),
    ("gloo_transport_recv.txt", "recv", "extra.py:11"),
])
def test_python_collectives_name_the_call_and_the_users_line(fixture: str, collective: str, line: str) -> None:
    wait = collective_wait(main_frames(fixture))
    assert wait is not None and not wait.native
    assert wait.collective == collective and wait.frame.file == "torch/distributed/distributed_c10d.py"
    assert wait.called_at is not None and f"{wait.called_at.file}:{wait.called_at.line}" == line


@pytest.mark.parametrize(("pattern", "fixture", "frame"), [
    ("ddp_reducer", "ddp_reducer_finalize_backward.txt", "c10d::Reducer::finalize_backward (libtorch_cpu.so)"),
    ("work_wait", "work_wait_all_reduce.txt", "c10d::Work::wait (libtorch_cpu.so)"),
    ("work_wait", "fsdp2_all_gather_in_backward_hook.txt", "c10d::Work::wait (libtorch_cpu.so)"),
    ("work_wait", "gloo_transport_recv.txt", "c10d::ProcessGroupGloo::RecvWork::wait (libtorch_cpu.so)"),
    ("gloo_transport", "gloo_transport_recv.txt", "gloo::transport::tcp::UnboundBuffer::waitRecv (libtorch_cpu.so)"),
])
def test_each_native_pattern_matches_its_frame_in_a_real_dump(pattern: str, fixture: str, frame: str) -> None:
    frames = main_frames(fixture)
    assert frame in [f.name for f in frames]
    assert native_pattern(Frame(frame, "", 0)).name == pattern
    # Without its Python frames the stack is still a collective wait: the native frames tell.
    assert collective_wait(tuple(f for f in frames if not f.file)) is not None


@pytest.mark.parametrize(("pattern", "frame"), [
    ("process_group_gloo", "c10d::ProcessGroupGloo::allreduce (libtorch_cpu.so)"),
    ("c10d_dispatch", "c10d::ops::(anonymous namespace)::allreduce_CPU (libtorch_cpu.so)"),
    ("c10d_dispatch", "c10d::ProcessGroup::allreduce (libtorch_cpu.so)"),
])
def test_issuing_patterns_match_frames_of_a_real_native_window(pattern: str, frame: str) -> None:
    text = (FIXTURES / "ddp_straggler_job_rank0.raw").read_text()
    assert frame in text
    assert native_pattern(Frame(frame, "", 0)).name == pattern


@pytest.mark.parametrize(("pattern", "frame"), [
    # No GPU pair here: these are written from NCCL's and c10d's symbol names, not captured.
    ("nccl", "ncclAllReduce (libnccl.so.2)"),
    ("process_group_nccl", "c10d::ProcessGroupNCCL::WorkNCCL::synchronize (libtorch_cuda.so)"),
    # torch 2.14.1's libtorch_cuda.so exports it (tests/unit/fixtures/torch_symbols)
    ("process_group_nccl", "c10d::nccl2::ProcessGroupNCCL::allreduce(std::vector<at::Tensor, std::allocator<at::Tensor> >&, "
                           "c10d::AllreduceOptions const&) (libtorch_cuda.so)"),
])
def test_nccl_patterns_on_symbol_names(pattern: str, frame: str) -> None:
    assert native_pattern(Frame(frame, "", 0)).name == pattern


def test_every_pattern_is_tested() -> None:
    src = Path(__file__).read_text()
    assert all(f'("{p.name}"' in src for p in NATIVE_PATTERNS)


@pytest.mark.parametrize("frame", [
    "THPEngine_run_backward (libtorch_python.so)", "torch::autograd::Engine::thread_main (libtorch_cpu.so)",
    "pthread_cond_wait (libc.so.6)", "time_sleep (libpython3.11.so.1.0)", "at::native::addmm_out (libtorch_cpu.so)",
    "std::condition_variable::wait (libstdc++.so.6.0.30)",
])
def test_compute_and_generic_waits_are_no_collective(frame: str) -> None:
    assert native_pattern(Frame(frame, "", 0)) is None


def test_native_raw_window_parses_and_python_only_matches_a_plain_window() -> None:
    [sample] = raw_main("ddp_reducer_record_native.raw", 12077)
    assert native_waits([sample]) == sample.count == 99
    plain = python_only(sample)
    assert plain.folded == ("thread (12077): MainThread;<module> (plain_ddp.py:103);main (plain_ddp.py:95);"
                            "Tensor.backward (torch/_tensor.py:623);backward (torch/autograd/__init__.py:395);"
                            "_engine_run_backward (torch/autograd/graph.py:979)")
    assert all(f.file for f in plain.frames) and plain.count == 99


def test_wait_ratios_single_out_the_straggler_of_a_real_ddp_job() -> None:
    rank0, rank1 = raw_main("ddp_straggler_job_rank0.raw", 24264), raw_main("ddp_straggler_job_rank1.raw", 24265)
    share = {r: native_waits(s) / sum(x.count for x in s) for r, s in (("0", rank0), ("1", rank1))}
    assert share["0"] > 0.7 and share["1"] < 0.1, share  # rank 1 computes twice as long: rank 0 waits
    for samples, expected in ((rank0, share["0"]), (rank1, share["1"])):
        ratios = WaitRatios()
        ratios.learn(samples)
        plain = [python_only(s) for s in samples]
        # Applied to the same window without native frames, the learned ratios give its share back.
        assert ratios.waits(plain) / sum(s.count for s in plain) == pytest.approx(expected)


def test_unlearned_stacks_count_by_their_python_frames() -> None:
    ratios = WaitRatios()
    [coll] = parse_folded("thread (1): MainThread;main (t.py:3);all_reduce (torch/distributed/distributed_c10d.py:3252) 4", 1)
    [comp] = parse_folded("thread (1): MainThread;main (t.py:3);Linear.forward (torch/nn/modules/linear.py:134) 6", 1)
    assert ratios.waits([coll, comp]) == 4 and not ratios.learned


def test_frames_from_json_keeps_native_frames_nameless_of_file() -> None:
    frames = frames_from_json({"frames": [
        {"name": "pthread_cond_wait", "short_filename": "libc.so.6", "line": 0, "module": "/lib/libc.so.6"},
        {"name": "main", "short_filename": "t.py", "line": 3, "module": None}]})
    assert frames == (Frame("main", "t.py", 3), Frame("pthread_cond_wait (libc.so.6)", "", 0))


def top_of(samples: list) -> tuple:
    return max(samples, key=lambda s: s.count).frames


def test_a_thread_computing_in_one_long_cpp_call_is_moving_a_blocked_one_is_not() -> None:
    blocked = raw_main("ddp_reducer_record_native.raw", 12077)
    computing = raw_main("ddp_straggler_job_rank1.raw", 24265)  # the straggler: backward's own compute
    assert not moving(blocked, top_of(blocked)) and moving(computing, top_of(computing))
    # the straggler's window, then most of a window blocked in the reducer: it waits
    blocked_after = [*computing, *(dataclasses.replace(s, count=s.count * 2) for s in blocked)]
    assert not moving(blocked_after, top_of(blocked_after))
    # its Python stack alone stands still at one line most of the time
    top = max(computing, key=lambda s: s.count)
    assert str(python_only(top).frames[-1]) == "_engine_run_backward (torch/autograd/graph.py:979)"

"""Frame rules, parsing, top-K and stall tracking of analysis/stacks.py, on synthetic stacks."""

from __future__ import annotations

import pytest

from profagent.analysis.stacks import (
    CATEGORIES,
    IDLE_PLACES_MAX,
    StallTracker,
    TopK,
    classify,
    classify_with_idle,
    idle_places,
    main_thread_sample,
    parse_folded,
    parse_frame,
    remember_idle_places,
    thread_states,
)
from profagent.sources.stacks.pyspy import PythonBuild, compatibility


def stack(*frames: str) -> tuple:
    return tuple(parse_frame(f) for f in frames)


ROOT_FRAME = "<module> (train.py:10)"  # the outermost frame of every stack below
CALL = "Module._call_impl (torch/nn/modules/module.py:1789)"
WAIT = "Condition.wait (threading.py:327)"

CASES = {
    "forward": [ROOT_FRAME, "train_step (train.py:5)", CALL, "Net.forward (model.py:20)"],
    "backward": [ROOT_FRAME, "Tensor.backward (torch/_tensor.py:623)", "backward (torch/autograd/__init__.py:395)",
                 "_engine_run_backward (torch/autograd/graph.py:979)"],
    "optimizer": [ROOT_FRAME, "Optimizer.profile_hook_step.<locals>.wrapper (torch/optim/optimizer.py:514)",
                  "SGD.step (torch/optim/sgd.py:127)", "_single_tensor_sgd (torch/optim/sgd.py:379)"],
    # the DataLoader's leaf is an idle wait: the innermost torch.utils.data frame wins
    "dataloader": [ROOT_FRAME, "_BaseDataLoaderIter.__next__ (torch/utils/data/dataloader.py:733)",
                   "_MultiProcessingDataLoaderIter._get_data (torch/utils/data/dataloader.py:1470)",
                   "Queue.get (multiprocessing/queues.py:113)", "Connection.poll (multiprocessing/connection.py:257)",
                   "wait (multiprocessing/connection.py:1136)", "_PollSelector.select (selectors.py:415)"],
    "host_sync": [ROOT_FRAME, "train_step (train.py:7)", "synchronize (torch/cuda/__init__.py:985)"],
    # a collective inside forward (DDP/FSDP): innermost wins
    "collective": [ROOT_FRAME, CALL, "Net.forward (model.py:20)", "all_reduce (torch/distributed/distributed_c10d.py:2500)",
                   "_exception_logger.<locals>.wrapper (torch/distributed/c10d_logger.py:81)"],
    # checkpoint_io beats everything below it, even a collective inside distributed checkpoint
    "checkpoint_io": [ROOT_FRAME, "save (torch/distributed/checkpoint/state_dict_saver.py:50)",
                      "all_gather_object (torch/distributed/distributed_c10d.py:3000)"],
    # compiling: anywhere in the stack
    "compile": [ROOT_FRAME, CALL, "_TorchDynamoContext.__call__.<locals>._fn (torch/_dynamo/eval_frame.py:655)",
                "ConvertFrame.__call__ (torch/_dynamo/convert_frame.py:1000)", "Net.forward (model.py:20)"],
    "idle": ["Thread._bootstrap (threading.py:1002)", "Worker.run (app.py:9)", "Queue.get (queue.py:171)", WAIT],
    "other": [ROOT_FRAME, "hot_loop (train.py:3)"],
}


@pytest.mark.parametrize("category", sorted(CASES))
def test_each_category_has_a_stack_that_gives_it(category: str) -> None:
    assert classify(stack(*CASES[category])) == category


def test_every_category_is_covered() -> None:
    assert sorted(CASES) == sorted(CATEGORIES)


def test_compiled_model_at_run_time_is_forward_not_compile() -> None:
    frames = stack(ROOT_FRAME, CALL, "_TorchDynamoContext.__call__.<locals>._fn (torch/_dynamo/eval_frame.py:655)",
                   "CompiledFxGraph.__call__ (torch/_inductor/output_code.py:460)", CALL)
    assert classify(frames) == "forward"


def test_autograd_profiler_and_function_apply_are_not_backward() -> None:
    assert classify(stack(ROOT_FRAME, "record_function.__exit__ (torch/autograd/profiler.py:951)")) == "other"
    assert classify(stack(ROOT_FRAME, "Function.apply (torch/autograd/function.py:575)")) == "other"


def test_item_is_invisible_but_python_level_syncs_are_seen() -> None:
    # tensor.item()/.cpu()/.tolist() are C methods: py-spy shows the calling line only
    assert classify(stack(ROOT_FRAME, "train_step (train.py:12)")) == "other"
    assert classify(stack(ROOT_FRAME, "Event.synchronize (torch/cuda/streams.py:225)")) == "host_sync"
    assert classify(stack(ROOT_FRAME, "synchronize (torch/cpu/__init__.py:70)")) == "host_sync"
    assert classify(stack(ROOT_FRAME, "Tensor.__repr__ (torch/_tensor.py:590)", "_str (torch/_tensor_str.py:700)")) == "host_sync"
    # Event.wait makes a *stream* wait: the host does not block
    assert classify(stack(ROOT_FRAME, "Event.wait (torch/cuda/streams.py:210)")) == "other"


def test_empty_stack_is_other() -> None:
    assert classify(()) == "other"


def test_parse_folded_marks_the_main_thread_and_keeps_counts() -> None:
    text = (
        "thread (4242): MainThread;<module> (t.py:12);main (t.py:11);hot_loop (t.py:5) 39\n"
        "thread (4244): blocker;Thread.run (threading.py:982);blocked (t.py:8);Condition.wait (threading.py:327) 38\n"
        "garbage line without count\n"
        "thread (4245);f (a;b.py:1) 2\n"
    )
    samples = parse_folded(text, pid=4242)
    assert [s.count for s in samples] == [39, 38, 2]
    assert [s.main for s in samples] == [True, False, False]
    assert samples[0].leaf.function == "hot_loop (t.py)"
    assert samples[0].thread == "MainThread"
    assert str(samples[1].leaf) == "Condition.wait (threading.py:327)"


def test_parse_folded_recognizes_the_main_thread_by_tid_when_renamed() -> None:
    samples = parse_folded("thread (77): trainer;<module> (t.py:1) 3\n", pid=77)
    assert samples[0].main


def test_topk_keeps_k_plus_other_and_counters_never_decrease() -> None:
    top = TopK(k=2, half_life=10.0)
    seen: dict[str, int] = {}

    def check() -> None:
        rows = top.series()
        assert len(rows) <= 3 and rows[-1][0] == "other"
        for fn, n in rows:
            assert n >= seen.get(fn, 0), f"{fn} went down"
            seen[fn] = n

    top.add({"a": 10, "b": 5, "c": 1}, 1.0)
    check()
    assert dict(top.series()) == {"a": 10, "b": 5, "other": 1}
    # the workload shifts: c becomes the hottest, a disappears
    for _ in range(10):
        top.add({"c": 20, "b": 5}, 10.0)
        check()
    fns = dict(top.series())
    assert set(fns) == {"c", "b", "other"}
    # a comes back: it resumes from its old count, never below
    for _ in range(10):
        top.add({"a": 50}, 10.0)
        check()
    assert dict(top.series())["a"] > 10
    # every sample is counted exactly once across all series ever exported
    total_in = 16 + 10 * 25 + 10 * 50
    assert sum(top._count.values()) + top.other == total_in


def test_topk_tracking_is_bounded() -> None:
    top = TopK(k=3, max_tracked=20)
    for i in range(500):
        top.add({f"f{i}": 1}, 1.0)
    assert len(top._score) <= 20 and len(top._count) <= 20
    assert len(top.series()) <= 4


def _main(folded: str, count: int = 10) -> list:
    return parse_folded(f"thread (1): MainThread;{folded} {count}\n", pid=1)


def test_stall_needs_an_identical_stack_for_longer_than_the_threshold() -> None:
    t = StallTracker(stall_seconds=5.0)
    same = _main("<module> (t.py:1);stuck (t.py:3)")
    assert not t.update(same, 0, 2, None).stalled
    assert not t.update(same, 2, 4, None).stalled
    status = t.update(same, 4, 6, None)
    assert status.stalled and status.started and status.unchanged_seconds == 6
    assert [f.name for f in status.frames] == ["<module>", "stuck"]
    again = t.update(same, 6, 8, None)
    assert again.stalled and not again.started  # logged once, not every window
    # two stacks in one window: the stack moved
    moving = same + _main("<module> (t.py:1);other (t.py:9)")
    assert not t.update(moving, 8, 10, None).stalled
    assert t.update(same, 10, 12, None).unchanged_seconds == 2


def test_stall_is_vetoed_by_busy_gpus_and_not_by_unknown() -> None:
    same = _main("<module> (t.py:1);wait_nccl (t.py:3)")
    busy, unknown, idle = StallTracker(1.0), StallTracker(1.0), StallTracker(1.0)
    for start in (0, 2, 4):
        b = busy.update(same, start, start + 2, True)
        u = unknown.update(same, start, start + 2, None)
        i = idle.update(same, start, start + 2, False)
    assert not b.stalled and b.unchanged_seconds == 6
    assert u.stalled and i.stalled


def test_thread_states_counts_py_spy_dump_json() -> None:
    dump = [
        {"thread_name": "MainThread", "active": True, "owns_gil": True},
        {"thread_name": "pin_memory", "active": False, "owns_gil": False},
        {"thread_name": "t2", "active": True, "owns_gil": False},
        {"thread_name": "t3", "active": False, "owns_gil": False},
    ]
    assert thread_states(dump) == {("active", "held"): 1, ("active", "not_held"): 1, ("idle", "not_held"): 2}
    assert thread_states({"unexpected": 1}) == {}


# `py-spy dump --json` of a training loop asleep in time.sleep (examples/train.py's
# --step-sleep): the main thread's innermost frame is the loop's own line, inactive.
SLEEPING_DUMP = [
    {"thread_name": "MainThread", "active": False, "owns_gil": False, "frames": [
        {"name": "train", "filename": "/w/examples/train.py", "short_filename": "train.py", "line": 93},
        {"name": "main", "filename": "/w/examples/train.py", "short_filename": "train.py", "line": 111},
    ]},
    {"thread_name": "pin_memory", "active": True, "owns_gil": True, "frames": [
        {"name": "hot", "filename": "/w/x.py", "short_filename": "x.py", "line": 3}]},
    {"thread_name": "t", "active": False, "frames": []},  # no frames: nothing to learn
    {"thread_name": "bad", "active": False, "frames": [{"name": "f", "line": "9"}]},  # malformed
]
SLEEPING = stack("main (train.py:111)", "train (train.py:93)")


def test_a_sleep_in_the_training_loop_is_idle_once_a_dump_saw_its_line_idle() -> None:
    places = idle_places(SLEEPING_DUMP)
    assert places == {("train", "train.py", 93)}
    assert classify(SLEEPING) == "other"  # the record window alone cannot tell
    assert classify_with_idle(SLEEPING, places) == "idle"
    assert classify_with_idle(SLEEPING, frozenset()) == "other"
    # the same function on another line (computing) stays what it was
    assert classify_with_idle(stack("main (train.py:111)", "train (train.py:90)"), places) == "other"
    assert idle_places({"unexpected": 1}) == frozenset() and idle_places([{"active": True, "frames": [1]}]) == frozenset()


def test_the_idle_rule_never_overrides_a_named_category() -> None:
    """A DataLoader wait seen idle by a dump is still `dataloader`; a forward pass too."""
    for category in ("dataloader", "forward", "collective", "compile", "checkpoint_io", "idle"):
        frames = stack(*CASES[category])
        leaf = frames[-1]
        assert classify_with_idle(frames, {(leaf.name, leaf.file, leaf.line)}) == category


def test_idle_places_are_bounded_and_keep_the_newest() -> None:
    known: dict = {}
    remember_idle_places(known, [("f", "a.py", i) for i in range(IDLE_PLACES_MAX + 10)])
    assert len(known) == IDLE_PLACES_MAX and ("f", "a.py", 0) not in known
    remember_idle_places(known, [("f", "a.py", 10)])  # seen again: newest, kept
    remember_idle_places(known, [("g", "b.py", i) for i in range(IDLE_PLACES_MAX - 1)])
    assert ("f", "a.py", 10) in known and len(known) == IDLE_PLACES_MAX


@pytest.mark.parametrize(
    ("pyspy", "target", "ok"),
    [
        ((0, 4, 3), PythonBuild(3, 11, False), True),
        ((0, 3, 14), PythonBuild(3, 12, False), False),
        ((0, 4, 0), PythonBuild(3, 13, False), True),
        ((0, 4, 1), PythonBuild(3, 14, False), False),
        ((0, 4, 2), PythonBuild(3, 14, False), True),
        ((0, 4, 3), PythonBuild(3, 13, True), False),  # free-threaded
        ((0, 4, 3), None, True),  # unknown: let py-spy try
    ],
)
def test_pyspy_version_fits_the_target_python(pyspy, target, ok) -> None:
    problem = compatibility(pyspy, target)
    assert (problem is None) == ok
    if problem:
        assert "\n" not in problem and ("pip install" in problem or "free-threaded" in problem)


# py-spy 0.4 `dump --json --nonblocking` of a real process (frames innermost first).
REAL_DUMP = [{"pid": 31296, "thread_id": 140394962754432, "thread_name": None, "os_thread_id": 31296,
              "active": True, "owns_gil": False, "frames": [
                  {"name": "f", "filename": "<string>", "module": None, "short_filename": "<string>", "line": 4,
                   "locals": None, "is_entry": False, "is_shim_entry": False},
                  {"name": "<module>", "filename": "<string>", "module": None, "short_filename": "<string>",
                   "line": 5, "locals": None, "is_entry": True, "is_shim_entry": True}],
              "process_info": None},
             {"pid": 31296, "thread_id": 2, "thread_name": "pin_memory", "os_thread_id": 31300, "active": False,
              "owns_gil": False, "frames": [{"name": "wait", "short_filename": "threading.py", "line": 320}]}]


def test_main_thread_sample_of_a_real_dump_is_root_first() -> None:
    sample = main_thread_sample(REAL_DUMP, 31296)
    assert sample is not None and sample.main and sample.count == 1
    assert [(f.name, f.line) for f in sample.frames] == [("<module>", 5), ("f", 4)]
    assert main_thread_sample(REAL_DUMP[1:], 31296) is None  # no main thread in it
    assert main_thread_sample({"not": "a list"}, 1) is None


def test_folding_caps_frame_names_depth_and_stacks_per_window() -> None:
    """Issue 41 item 3: 600 frames of 4,000-character names and files become 200 cut frames
    under one "… 400 frames" root frame; the leaf, the thread and the classification stay."""
    from profagent.analysis import stacks as st

    long_name, long_file = "f" * 4000, "/srv/" + "d" * 4000 + "/torch/nn/modules/module.py"
    line = "thread (7): MainThread;" + ";".join(f"{long_name} ({long_file}:3)" for _ in range(600)) + " 5"
    folded = st.fold_capped(line, 7)
    [sample] = folded.samples
    assert sample.main and sample.count == 5 and folded.dropped_stacks == 0
    assert len(sample.frames) == st.MAX_DEPTH + 1 and sample.frames[0].name == "… 400 frames"
    leaf = sample.frames[-1]
    assert leaf.name == "f" * st.MAX_FRAME_CHARS + "…" and leaf.file.endswith("torch/nn/modules/module.py")
    assert len(leaf.file) == st.MAX_FRAME_CHARS + 1 and leaf.line == 3
    assert sample.folded.startswith("thread (7): MainThread;… 400 frames;")
    assert len(sample.folded) < (st.MAX_DEPTH + 1) * (2 * st.MAX_FRAME_CHARS + 20)
    assert st.classify(sample.frames) == "forward"  # the cut file still names its folder
    # distinct stacks per window, then characters per window
    many = "\n".join(f"thread (7): MainThread;main (t.py:1);f{i} (t.py:{i}) 2" for i in range(st.MAX_STACKS + 10))
    capped = st.fold_capped(many, 7)
    assert len(capped.samples) == st.MAX_STACKS and capped.dropped_stacks == 10 and capped.dropped_samples == 20
    wide = "\n".join([line] * 100)
    capped = st.fold_capped(wide, 7)
    assert 0 < len(capped.samples) < 100 and capped.dropped_stacks == 100 - len(capped.samples)
    assert sum(len(s.folded) for s in capped.samples[:-1]) < st.MAX_WINDOW_CHARS
    # a short stack is kept exactly as written
    [plain] = st.parse_folded("thread (7): MainThread;a (b.py:1);c (d.py:2) 4", 7)
    assert plain.folded == "thread (7): MainThread;a (b.py:1);c (d.py:2)" and len(plain.frames) == 2

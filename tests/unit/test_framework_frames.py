"""The user's line in framework jobs, from real py-spy dumps of HF ``Trainer``, accelerate and
Lightning (tests/unit/fixtures/frameworks/README.md): py-spy shortens the frameworks' files
to ``transformers/…``, ``accelerate/…``, ``pytorch_lightning/…``; none of them is ever the
user's line, in the hang's "called at" and places nor in the stall's warning, which names
the line every rank stands on when they all stand on one (a save)."""

from __future__ import annotations

from pathlib import Path

import pytest

from profagent.analysis.collectives import collective_wait, parse_dump_text
from profagent.analysis.findings import steps
from profagent.analysis.findings.hang import hang
from profagent.analysis.findings.inputs import AnalysisInputs
from profagent.analysis.stacks import is_user, own_frame, parse_frame
from profagent.config import FindingsConfig
from profagent.contracts import Frame, RankStall, RankSteps, TimelineSnapshot

FIXTURES = Path(__file__).parent / "fixtures" / "frameworks"
USER_FILES = {"hf_job.py", "acc_job.py", "pl_job.py", "pl_save.py"}  # the captured programs


def main_frames(name: str) -> tuple[Frame, ...]:
    return next(t for t in parse_dump_text((FIXTURES / name).read_text()) if t.name == "MainThread").frames


DUMPS = sorted(p.name for p in FIXTURES.glob("*.txt") if not p.name.endswith(".py.txt"))


def test_no_framework_frame_is_the_users() -> None:
    frames = [f for name in DUMPS for f in main_frames(name)]
    assert {"transformers", "accelerate", "pytorch_lightning", "torch"} <= {f.file.split("/")[0] for f in frames}
    for f in frames:
        assert is_user(f) == (f.file in USER_FILES), f


@pytest.mark.parametrize(("name", "line"), [
    ("hf_trainer_rank0_ddp_init.txt", "main (hf_job.py:24)"),
    ("accelerate_rank0_gather.txt", "main (acc_job.py:17)"),
    ("lightning_rank0_barrier.txt", "Sync.on_train_batch_end (pl_job.py:24)"),
    ("lightning_callback_torch_save.txt", "Save.on_train_batch_end (pl_save.py:22)"),
])
def test_the_users_line_is_the_innermost_frame_of_its_own_code(name: str, line: str) -> None:
    frames = main_frames(name)
    assert str(own_frame(frames)) == steps.user_line(frames) == line


def test_paths_py_spy_left_whole_are_libraries_by_their_directory() -> None:
    libraries = ("/work/main/.venv/lib/python3.11/site-packages/accelerate/accelerator.py",
                 "/usr/lib/python3/dist-packages/transformers/trainer.py",
                 "/root/.pyenv/versions/3.11.7/lib/python3.11/threading.py",
                 "lightning/pytorch/trainer/trainer.py", "lightning_fabric/utilities/cloud_io.py",
                 "deepspeed/runtime/engine.py", "peft/peft_model.py", "torchmetrics/metric.py")
    for path in libraries:
        assert not is_user(Frame("f", path, 1)), path
    for path in ("train.py", "/home/me/project/train.py", "models/net.py", "./scripts/finetune.py"):
        assert is_user(Frame("f", path, 1)), path


def test_called_at_is_the_users_line_not_the_frameworks_gather() -> None:
    wait = collective_wait(main_frames("accelerate_rank0_gather.txt"))
    assert wait is not None and wait.collective == "all_gather"
    assert str(wait.called_at) == "main (acc_job.py:17)"  # not _gpu_gather_one (accelerate/utils/operations.py:345)
    wait = collective_wait(main_frames("lightning_rank0_barrier.txt"))
    assert wait is not None and wait.collective == "barrier"
    assert str(wait.called_at) == "Sync.on_train_batch_end (pl_job.py:24)"  # not DDPStrategy.barrier


def test_an_accelerate_hang_names_the_users_lines() -> None:
    rank0 = RankStall("0", True, 30.0, "job", main_frames("accelerate_rank0_gather.txt"))
    rank1 = RankStall("1", True, 30.0, "job", main_frames("accelerate_rank1_culprit.txt"))
    [f] = hang([rank0, rank1], "job")
    assert f.rank == "1" and f.evidence["diagnosis"] == "culprit", f.summary
    assert "rank 1 at main (acc_job.py:16)" in f.summary and "called at main (acc_job.py:17)" in f.summary, f.summary
    assert "accelerate/" not in f.summary.split("called at")[1], f.summary


def ranks_stopped(*names: str) -> tuple[RankSteps, ...]:
    quiet = FindingsConfig().stall_warning_seconds + 5
    return tuple(RankSteps(
        "job", name, 10 + i, 100, 99, 2.0, (0,) * 15, {}, 100, 500, 50, 0.02, 0.025, 0.03, 50.0, 1.0, {}, "",
        quiet, quiet + 0.02, (0,) * 15, 0.0, 0, step_collectives=7) for i, name in enumerate(names))


def test_a_job_wide_stall_names_the_line_every_rank_stands_on() -> None:
    """Every rank in a checkpoint save from a Lightning callback (``torch.save``), each as many
    collectives into its step: the warning names the save's line, not torch's or Lightning's."""
    frames = main_frames("lightning_callback_torch_save.txt")
    stalls = tuple(RankStall(r, False, 31.0, "job", frames) for r in ("0", "1"))
    inputs = AnalysisInputs(config=FindingsConfig(), now=1000.0, timeline=TimelineSnapshot(ranks_stopped("0", "1")),
                            stalls=stalls)
    [f] = steps.analyze_stall(inputs)
    assert f.rank is None and f.evidence["holding_ranks"] == []
    assert ("every rank seen here stands at Save.on_train_batch_end (pl_save.py:22) (rank 0 in the forward or host "
            "code, rank 1 in the forward or host code): a save") in f.summary, f.summary
    assert f.evidence["locations"] == {"0": "Save.on_train_batch_end (pl_save.py:22)",
                                       "1": "Save.on_train_batch_end (pl_save.py:22)"}
    # ranks on different lines: each named with its own
    other = (parse_frame("<module> (pl_save.py:32)"), parse_frame("main (pl_save.py:29)"))
    inputs = AnalysisInputs(config=FindingsConfig(), now=1000.0, timeline=TimelineSnapshot(ranks_stopped("0", "1")),
                            stalls=(stalls[0], RankStall("1", False, 31.0, "job", other)))
    [f] = steps.analyze_stall(inputs)
    assert ("every rank seen here waits (rank 0 in the forward or host code at Save.on_train_batch_end "
            "(pl_save.py:22), rank 1 in the forward or host code at main (pl_save.py:29))") in f.summary, f.summary

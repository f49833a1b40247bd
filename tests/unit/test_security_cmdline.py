"""The cmdline label carries no secret: program and script by default, redacted arguments on opt-in."""

from __future__ import annotations

import pytest

from profagent.target.cmdline import label_cmdline

ARGV = ["/usr/bin/python3", "/home/u/train.py", "--api-key=SECRET123", "--password", "hunter2", "--lr", "0.1"]


@pytest.mark.parametrize(("argv", "label"), [
    (ARGV, "python3 train.py"),
    (["python3", "-u", "-m", "torch.distributed.run", "--rdzv-token", "T"], "python3 -m torch.distributed.run"),
    (["python", "-c", "import secret; token='x'"], "python -c"),
    (["/opt/bin/torchrun", "--nproc-per-node=8", "train.py", "--token=T"], "torchrun"),
    (["python3.11"], "python3.11"),
])
def test_default_label_has_no_arguments(argv: list[str], label: str) -> None:
    assert label_cmdline(argv) == label


def test_opt_in_redacts_both_forms() -> None:
    label = label_cmdline([*ARGV, "--hf_token", "hf_abc", "--db-secret=s", "--AUTH-header", "h", "--seed", "1"], True)
    assert label == ("python3 /home/u/train.py --api-key=*** --password *** --lr 0.1 "
                     "--hf_token *** --db-secret=*** --AUTH-header *** --seed 1")
    for secret in ("SECRET123", "hunter2", "hf_abc", "=s ", " h "):
        assert secret not in label + " "

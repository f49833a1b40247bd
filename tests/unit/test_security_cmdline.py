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


@pytest.mark.parametrize(("args", "shown"), [
    # issue 25, item 15: each was shown in clear
    (["-p", "hunter2"], "-p ***"),
    (["--pass", "hunter2"], "--pass ***"),
    (["--cred", "hunter2"], "--cred ***"),
    (["--jwt", "eyJhbGciOi.x.y"], "--jwt ***"),
    (["--bearer", "hunter2"], "--bearer ***"),
    (["--db", "postgres://u:hunter2@host:5432/db"], "--db postgres://u:***@host:5432/db"),
    (["HF_TOKEN=hunter2"], "HF_TOKEN=***"),
    # the same secrets in their other spellings
    (["-p=hunter2", "--pass=hunter2", "--passphrase", "hunter2"], "-p=*** --pass=*** --passphrase ***"),
    (["--url=https://me:hunter2@hub.example/x"], "--url=https://me:***@hub.example/x"),
    (["https://me:hunter2@hub.example/x"], "https://me:***@hub.example/x"),
    (["db.password=hunter2", "AWS_SECRET_ACCESS_KEY=hunter2", "session_cookie=hunter2"],
     "db.password=*** AWS_SECRET_ACCESS_KEY=*** session_cookie=***"),
    (["--header", "Authorization: Bearer hunter2"], "--header Authorization: Bearer ***"),
    (["--private-key-file", "/k", "--Credentials", "hunter2"], "--private-key-file *** --Credentials ***"),
    # the trade-off: -p is hidden even where it means a port or a count
    (["-p", "8"], "-p ***"),
    # not secrets: kept as they are
    (["--lr", "0.1", "--epochs=3", "-m", "x", "--port", "29500"], "--lr 0.1 --epochs=3 -m x --port 29500"),
    (["--data", "s3://bucket/path", "https://hub.example/model", "user@host:/data"],
     "--data s3://bucket/path https://hub.example/model user@host:/data"),
    (["lr=0.1", "model.name=llama", "--keep", "3", "--seed", "1"], "lr=0.1 model.name=llama --keep 3 --seed 1"),
])
def test_opt_in_redacts_every_secret_spelling(args: list[str], shown: str) -> None:
    label = label_cmdline(["python3", "train.py", *args], True)
    assert label == f"python3 train.py {shown}"
    if "hunter2" in " ".join(args):
        assert "hunter2" not in label

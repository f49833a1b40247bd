"""The job id from the first scrape: torchrun's command line, Slurm, Kubernetes, else HOST:PID.

Fixture /proc trees (cmdline and environ files under a folder) stand for the launcher;
``resolve_job_id`` is the pure decision, ``read_argv`` the bounded read.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from profagent.contracts import ROLE_LAUNCHER, ROLE_MAIN, ProcessInfo
from profagent.system.procfs import read_argv, read_environ
from profagent.target.jobid import id_from_torchrun, resolve_job_id


def _proc(pid: int, role: str, ppid: int = 1) -> ProcessInfo:
    rank = "" if role == ROLE_LAUNCHER else "0"
    return ProcessInfo(pid, ppid, 0.0, role, rank, rank, "2", "torchrun")


def _fixture(root: Path, pid: int, argv: list[str], env: dict[str, str]) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))


def _launcher_id(tmp_path: Path, argv: list[str], env: dict[str, str] | None = None, ranks: dict[int, dict] | None = None):
    """The job id of a tree read from a fixture /proc: launcher PID 40, ranks as given."""
    _fixture(tmp_path, 40, argv, env or {})
    procs = [_proc(40, ROLE_LAUNCHER)]
    envs = {40: read_environ(tmp_path, 40)}
    for pid, rank_env in (ranks or {}).items():
        _fixture(tmp_path, pid, ["python3", "train.py"], rank_env)
        procs.append(_proc(pid, ROLE_MAIN, 40))
        envs[pid] = read_environ(tmp_path, pid)
    return resolve_job_id(procs, envs, {40: read_argv(tmp_path, 40)}, 40, "node-a")


@pytest.mark.parametrize("argv", [
    ["/usr/bin/python3", "/usr/local/bin/torchrun", "--nnodes", "2", "--rdzv-id", "job-7", "train.py"],
    ["torchrun", "--nnodes=2", "--rdzv_id=job-7", "--rdzv-backend", "c10d", "train.py", "--lr", "1"],
    ["torchrun", "--run-id", "job-7", "train.py"],
    ["torchrun", "--run_id=job-7", "train.py"],
    ["python3", "-m", "torch.distributed.run", "--no-python", "--rdzv-id", "job-7", "./train.sh"],
    ["torchrun", "--rdzv-id", "other", "--rdzv-id", "job-7", "-m", "pkg.train"],  # argparse: the last one
])
def test_torchrun_names_its_job_before_any_rank(tmp_path, argv) -> None:
    assert _launcher_id(tmp_path, argv) == ("job-7", True)


@pytest.mark.parametrize("argv", [
    ["torchrun", "--nproc-per-node", "2", "train.py", "--rdzv-id", "mine"],  # the script's own argument
    ["torchrun", "--rdzv-id", "none", "train.py"],  # torchrun's default: no name
    ["torchrun", "--standalone", "--rdzv-id", "x", "train.py"],  # torchrun replaces it by a uuid
    ["torchrun", "--rdzv-id"],  # no value
    ["python3", "train.py", "--rdzv-id", "x"],  # not a launcher
    ["python3", "-m", "pkg.train", "--run-id", "x"],
])
def test_no_name_on_the_command_line_is_host_and_pid(tmp_path, argv) -> None:
    assert _launcher_id(tmp_path, argv) == ("node-a:40", False)


def test_slurm_then_rank_run_id_then_command_line(tmp_path) -> None:
    argv = ["torchrun", "--rdzv-id", "cmd-1", "train.py"]
    assert _launcher_id(tmp_path / "a", argv, {"SLURM_JOB_ID": "812"}) == ("812", True)
    ranks = {41: {"RANK": "0", "TORCHELASTIC_RUN_ID": "cmd-1"}}
    assert _launcher_id(tmp_path / "b", argv, ranks=ranks) == ("cmd-1", True)
    # a --standalone launcher's ranks carry torchrun's own random id: that one names the job
    standalone = ["torchrun", "--standalone", "train.py"]
    assert _launcher_id(tmp_path / "c", standalone, ranks={41: {"TORCHELASTIC_RUN_ID": "uuid-9"}}) == ("uuid-9", True)


def test_kubernetes_operator_sets_torchruns_environment_form(tmp_path) -> None:
    argv = ["torchrun", "--nnodes", "2", "train.py"]
    assert _launcher_id(tmp_path / "a", argv, {"PET_RDZV_ID": "pytorchjob-3"}) == ("pytorchjob-3", True)
    # the command line wins over the environment (as in torchrun), and --standalone over both
    argv = ["torchrun", "--rdzv-id", "cmd-2", "train.py"]
    assert _launcher_id(tmp_path / "b", argv, {"PET_RDZV_ID": "pytorchjob-3"}) == ("cmd-2", True)
    standalone = ["torchrun", "--standalone", "train.py"]
    assert _launcher_id(tmp_path / "c", standalone, {"PET_RDZV_ID": "pytorchjob-3"}) == ("node-a:40", False)
    # PET_RDZV_ID in a process that is no torchrun names nothing
    assert _launcher_id(tmp_path / "d", ["python3", "x.py"], {"PET_RDZV_ID": "p"}) == ("node-a:40", False)


def test_two_nodes_whose_launchers_share_a_pid_get_two_ids() -> None:
    procs = [_proc(7, ROLE_LAUNCHER)]
    ids = {resolve_job_id(procs, {7: {}}, {7: ["torchrun", "train.py"]}, 7, host).value for host in ("n0", "n1")}
    assert ids == {"n0:7", "n1:7"}


def test_a_huge_command_line_is_read_up_to_its_cap(tmp_path) -> None:
    """Any user sets the launcher's command line: only its start is read, each argument bounded."""
    _fixture(tmp_path, 40, ["torchrun", "--rdzv-id", "j" * 5000, *["--x"] * 100_000], {})
    argv = read_argv(tmp_path, 40)
    assert len(argv) < 10 and len(argv[2]) < 5000
    assert id_from_torchrun(argv) == argv[2]  # bounded, still an id (hashed: distinct values stay distinct)
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "cmdline").write_bytes(b"")  # a kernel thread
    assert read_argv(tmp_path, 41) == []

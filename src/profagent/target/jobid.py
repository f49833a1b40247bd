"""The job id: one name per training job, the same on every node, from the first scrape.

Series of one job from several nodes join on ``job_id``, so it must name the job, not a
process of one node (the order of preference is above ``resolve_job_id``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from profagent.contracts import ROLE_LAUNCHER, ProcessInfo

ID_FLAGS = ("--rdzv-id", "--rdzv_id", "--run-id", "--run_id")
# torchrun's options that take no value: any other option consumes the next argument
# (unless written --x=v), so the first argument left is the training script.
_NO_VALUE = frozenset({"--standalone", "-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path",
                       "--virtual-local-rank", "--virtual_local_rank", "-h", "--help"})
_MODULES = ("torch.distributed.run", "torch.distributed.launch")
NOT_AN_ID = "none"  # torchrun's default --rdzv-id


class JobId(NamedTuple):
    value: str
    named: bool  # False for the HOST:PID fallback, which a rank's id may replace later


def torchrun_args(argv: list[str]) -> list[str] | None:
    """The arguments of a torchrun launcher (after ``torchrun`` or ``-m torch.distributed.run``),
    None when ``argv`` is not one."""
    for i, arg in enumerate(argv[:3]):  # torchrun, python torchrun, python -m torch.distributed.run
        if os.path.basename(arg) == "torchrun":
            return argv[i + 1:]
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] in _MODULES:
            return argv[i + 2:]
    return None


def id_from_torchrun(argv: list[str]) -> str | None:
    """The rendezvous id a torchrun command line names, None if none (or ``--standalone``)."""
    args = torchrun_args(argv)
    if args is None:
        return None
    found, standalone, i = None, False, 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-"):
            break  # the training script: what follows is its own
        name, eq, value = arg.partition("=")
        if name == "--standalone":
            standalone = True
        elif not eq and name not in _NO_VALUE:
            value = args[i + 1] if i + 1 < len(args) else ""
            i += 1
        if name in ID_FLAGS:
            found = value  # argparse keeps the last one
        i += 1
    return None if standalone or not usable(found) else found


def usable(value: str | None) -> bool:
    return bool(value) and value != NOT_AN_ID


# 1. ``SLURM_JOB_ID`` of any process of the tree (the launcher first);
# 2. ``TORCHELASTIC_RUN_ID`` of a rank (torchrun sets it in the ranks only);
# 3. a torchrun launcher's own command line: ``--rdzv-id``/``--rdzv_id``/``--run-id``/
#    ``--run_id``, as ``--x=v`` or ``--x v``, before the training script (whose own
#    arguments may reuse the names); ignored with ``--standalone``, where torchrun makes a
#    random id of its own that the ranks will carry;
# 4. ``PET_RDZV_ID`` of the launcher: torchrun's environment form of ``--rdzv-id``, which
#    Kubernetes operators (Kubeflow's PyTorchJob) set;
# 5. else ``HOST:PID`` of the root: a bare PID is not a name, two nodes (or two
#    containers, where PIDs are small) can share it.
#
# 2 to 4 are one value for a torchrun job, so a launcher seen before its ranks has its
# final id at once. torchrun's default rendezvous id ``none`` names nothing.
def resolve_job_id(
    procs: Iterable[ProcessInfo],
    envs: Mapping[int, Mapping[str, str]],
    argvs: Mapping[int, list[str]],
    root_pid: int,
    host: str,
) -> JobId:
    """The job id of one tree (see the module doc); ``argvs`` holds the launchers' arguments."""
    ordered = sorted(procs, key=lambda p: (p.role != ROLE_LAUNCHER, p.pid))
    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        for proc in ordered:
            value = envs.get(proc.pid, {}).get(var)
            if usable(value):
                return JobId(value, True)  # type: ignore[arg-type]  # usable: a str
    for proc in ordered:
        value = id_from_torchrun(argvs.get(proc.pid, []))
        if value is not None:
            return JobId(value, True)
    for proc in ordered:
        if proc.role == ROLE_LAUNCHER or proc.pid == root_pid:
            value = envs.get(proc.pid, {}).get("PET_RDZV_ID")
            args = torchrun_args(argvs.get(proc.pid, []))
            if usable(value) and args is not None and "--standalone" not in args:
                return JobId(value, True)  # type: ignore[arg-type]
    return JobId(f"{host}:{root_pid}", False)

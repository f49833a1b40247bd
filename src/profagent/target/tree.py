"""Where a process's rank and job come from (torch's, MPI's and Slurm's variables).

The tree itself (``ProcessTree``, ``ProcessInfo``, the roles) is a data contract:
``profagent.contracts``. Which processes of a tree are ranks: ``target/ranks.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

CMDLINE_MAX = 80

# Where a process's rank comes from, first found wins: (rank, local rank, world size).
# torchrun, accelerate and deepspeed's launcher set RANK; Open MPI's mpirun OMPI_*;
# MPICH's and Intel MPI's hydra PMI_*; Slurm's srun SLURM_*. A launcher that sets
# LOCAL_RANK with WORLD_SIZE and no RANK (PyTorch Lightning's own) comes last: see
# LOCAL_RANK_VARS.
RANK_VARS = (
    ("RANK", "LOCAL_RANK", "WORLD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE"),
    ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
)
# A rank named by its node and its place on it (Lightning's children): its global rank is
# NODE_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK (LOCAL_RANK alone on node 0, or where the
# node's rank count is not known).
LOCAL_RANK_VARS = ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE")
# Every variable that says which rank a process is: a child whose values all equal its
# rank's inherited them (a DataLoader worker), it is not a rank of its own.
IDENTITY_VARS = tuple(dict.fromkeys([v for vs in RANK_VARS for v in vs] + list(LOCAL_RANK_VARS) + ["GROUP_RANK"]))
# The job's identity from the environment, in order of preference (else a torchrun
# launcher's command line, else HOST:PID: target/jobid.py).
JOB_VARS = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
_MAX_DIGITS = 9  # a rank computed from numbers the job's owner chose stays a small number


def rank_from_env(env: Mapping[str, str]) -> tuple[str, str, str] | None:
    """(rank, local_rank, world_size) from the first of RANK_VARS the environment has,
    else from LOCAL_RANK with WORLD_SIZE, else None."""
    for rank, local, world in RANK_VARS:
        if rank in env:
            return env[rank], env.get(local, ""), env.get(world, "")
    return local_rank_identity(env)


def local_rank_identity(env: Mapping[str, str], local_world: str = "") -> tuple[str, str, str] | None:
    """(rank, local_rank, world_size) of a process named by LOCAL_RANK and WORLD_SIZE (no
    RANK), with ``local_world`` where LOCAL_WORLD_SIZE is not set; None without both."""
    local, world = env.get("LOCAL_RANK"), env.get("WORLD_SIZE")
    if local is None or world is None:
        return None
    return global_rank(local, env.get("NODE_RANK", ""), env.get("LOCAL_WORLD_SIZE") or local_world), local, world


def global_rank(local: str, node_rank: str, local_world: str) -> str:
    """NODE_RANK * local world + LOCAL_RANK; LOCAL_RANK itself on node 0 (or no node),
    or where a number is missing or not a small non-negative integer."""
    if node_rank in ("", "0") or not all(_small(v) for v in (local, node_rank, local_world)):
        return local
    return str(int(node_rank) * int(local_world) + int(local))


def _small(value: str) -> bool:
    return value.isascii() and value.isdigit() and len(value) <= _MAX_DIGITS

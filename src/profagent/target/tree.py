"""The process tree model: what one refresh of a target yields.

Roles: ``main`` (a rank process), ``dataloader`` (any descendant of a rank, attributed
to it), ``launcher`` (above the ranks, rank "").
"""

from __future__ import annotations

CMDLINE_MAX = 80

# Where a process's rank comes from, torch's variables first, then Slurm's:
# (rank, local rank, world size).
RANK_VARS = (("RANK", "LOCAL_RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"))
# The job's identity, in order of preference (else the root PID).
JOB_VARS = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")


def rank_from_env(env: dict[str, str]) -> tuple[str, str, str] | None:
    """(rank, local_rank, world_size) from torch's or Slurm's variables, else None."""
    for rank, local, world in RANK_VARS:
        if rank in env:
            return env[rank], env.get(local, ""), env.get(world, "")
    return None




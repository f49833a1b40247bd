"""Where a process's rank and job come from (torch's and Slurm's variables).

The tree itself (``ProcessTree``, ``ProcessInfo``, the roles) is a data contract:
``profagent.contracts``.
"""

from __future__ import annotations

CMDLINE_MAX = 80

# Where a process's rank comes from, torch's variables first, then Slurm's:
# (rank, local rank, world size).
RANK_VARS = (("RANK", "LOCAL_RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"))
# The job's identity from the environment, in order of preference (else a torchrun
# launcher's command line, else HOST:PID: target/jobid.py).
JOB_VARS = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")


def rank_from_env(env: dict[str, str]) -> tuple[str, str, str] | None:
    """(rank, local_rank, world_size) from torch's or Slurm's variables, else None."""
    for rank, local, world in RANK_VARS:
        if rank in env:
            return env[rank], env.get(local, ""), env.get(world, "")
    return None

"""The process tree model: what one refresh of a target yields.

Roles: ``main`` (a rank process), ``dataloader`` (any descendant of a rank, attributed
to it), ``launcher`` (above the ranks, rank "").
"""

from __future__ import annotations

from dataclasses import dataclass

from profagent.target.placement import NOWHERE, Placement

ROLE_MAIN = "main"
ROLE_DATALOADER = "dataloader"
ROLE_LAUNCHER = "launcher"
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


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    ppid: int
    create_time: float
    role: str
    rank: str
    local_rank: str
    world_size: str
    cmdline: str
    job_id: str = ""
    placement: Placement = NOWHERE  # pod, Slurm step and user: labels of target_info only


@dataclass(frozen=True)
class ProcessTree:
    """One consistent view of what we watch. ``alive`` is False once every process is gone.

    ``attach`` watches one job (``job_id``); ``watch`` mode merges every job of the node
    into one tree, so per-process data must be keyed by ``ProcessInfo.job_id``, and
    ``jobs`` lists each job with whether it is alive (ended jobs stay for a grace period).
    """

    job_id: str
    root_pid: int
    processes: tuple[ProcessInfo, ...]
    alive: bool
    jobs: tuple[tuple[str, bool], ...] = ()

    def job_status(self) -> dict[str, bool]:
        """job_id -> alive, for profagent_target_up."""
        if self.jobs or not self.job_id:  # watch mode (job_id ""): only the listed jobs
            return dict(self.jobs)
        return {self.job_id: self.alive}

    def ranks(self) -> list[str]:
        return sorted({p.rank for p in self.processes if p.role == ROLE_MAIN}, key=_rank_key)

    def mains(self) -> list[ProcessInfo]:
        return [p for p in self.processes if p.role == ROLE_MAIN]

    def by_pid(self) -> dict[int, ProcessInfo]:
        return {p.pid: p for p in self.processes}


def _rank_key(rank: str) -> tuple[int, str]:
    return (int(rank), "") if rank.isdigit() else (1 << 30, rank)

"""Which processes of a job's tree are ranks, from any launcher, and which are their workers.

A rank has its own identity in its environment (``tree.rank_from_env``), or one its
launcher's structure gives it where its environment is silent:

- a process that launched children with LOCAL_RANK=1.. and WORLD_SIZE (PyTorch
  Lightning's own launcher) is local rank 0 of their world;
- the children that ``torch.multiprocessing.spawn`` started (multiprocessing's spawn or
  forkserver command line) of a process iterating no DataLoader (torch's DataLoader
  handles SIGCHLD; a spawn launcher does not) are ranks 0..N-1 in start order.

Below a rank, a process is its worker (``dataloader``) unless its identity differs from
the rank's (its values are not the ones the rank passed on). docs/service.md has the table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from profagent.contracts import ROLE_DATALOADER, ROLE_LAUNCHER, ROLE_MAIN
from profagent.target.tree import IDENTITY_VARS, global_rank, local_rank_identity, rank_from_env

# How multiprocessing started a process, from its command line (``started_by``).
MP_SPAWN = "spawn"
MP_FORKSERVER = "forkserver"


@dataclass(frozen=True)
class Seen:
    """What the classifier knows of one process of the tree."""

    ppid: int
    create_time: float
    env: Mapping[str, str]
    started_by: str = ""  # MP_SPAWN, MP_FORKSERVER or ""


@dataclass(frozen=True)
class Role:
    role: str
    rank: str = ""
    local_rank: str = ""
    world_size: str = ""


def started_by(argv: list[str]) -> str:
    """MP_SPAWN for a process multiprocessing's spawn started (``-c from
    multiprocessing.spawn import spawn_main; ...`` ``--multiprocessing-fork``),
    MP_FORKSERVER for its forkserver and the processes forked from it, else ""."""
    code, i = "", 1
    while i < len(argv) - 1:  # the interpreter's options, up to -c (a script's -c is its own)
        if argv[i] == "-c":
            code = argv[i + 1]
            break
        if not argv[i].startswith("-"):
            return ""
        i += 2 if argv[i] in ("-X", "-W") else 1
    if "from multiprocessing.spawn import spawn_main" in code and argv[-1] == "--multiprocessing-fork":
        return MP_SPAWN
    if code.startswith("from multiprocessing.forkserver import main"):
        return MP_FORKSERVER
    return ""


def classify(
    procs: Mapping[int, Seen],
    handles_sigchld: Callable[[int], bool],
    is_torchrun: Callable[[int], bool],
) -> dict[int, Role]:
    """The role and rank of every process, in tree order (each top, then depth first by
    PID). ``handles_sigchld(pid)``: whether the process catches SIGCHLD (read only for a
    process without a rank that has multiprocessing children); ``is_torchrun(pid)``:
    whether it is torchrun (read only for a tree where nothing is a rank, or a process
    with a rank identity and children: ``srun torchrun`` with one rank)."""
    children: dict[int, list[int]] = {}
    for pid, seen in procs.items():
        children.setdefault(seen.ppid, []).append(pid)
    for kids in children.values():
        kids.sort()
    tops = sorted(pid for pid, seen in procs.items() if seen.ppid not in procs)

    def spawned(pid: int) -> list[int]:
        """The processes ``pid`` started through multiprocessing, in start order."""
        out = [c for c in children.get(pid, ()) if procs[c].started_by == MP_SPAWN]
        for server in children.get(pid, ()):
            if procs[server].started_by == MP_FORKSERVER:
                out += [c for c in children.get(server, ()) if procs[c].started_by == MP_FORKSERVER]
        return sorted(out, key=lambda c: (procs[c].create_time, c))

    def spawn_launcher(pid: int) -> list[int]:
        kids = spawned(pid)
        return kids if kids and not handles_sigchld(pid) else []

    def any_rank() -> bool:
        return any(rank_from_env(s.env) is not None for s in procs.values()) or any(
            spawn_launcher(pid) for pid in procs)

    assigned: dict[int, Role] = {}  # ranks their launcher numbered
    out: dict[int, Role] = {}
    single: list[bool] = []  # whether nothing is a rank (read once, when first needed)
    # (pid, main) pairs, main the nearest rank above pid; a stack, not recursion: trees are deep at will
    todo: list[tuple[int, int | None]] = [(t, None) for t in reversed(tops)]
    while todo:
        pid, main = todo.pop()
        env = procs[pid].env
        if pid in assigned:
            me = assigned[pid]
        elif main is not None:
            me = _below(env, procs[main].env, out[main])
        elif launched := _launched(pid, children.get(pid, ()), procs):
            me = launched.pop(pid)
            assigned.update(launched)
        elif _starts_ranks(env, children.get(pid, ()), procs) or (
                pid in children and rank_from_env(env) is not None and is_torchrun(pid)):
            me = Role(ROLE_LAUNCHER)
        elif (own := rank_from_env(env)) is not None:
            me = Role(ROLE_MAIN, *own)
        elif ranks := spawn_launcher(pid):
            world = str(len(ranks))
            assigned.update({r: Role(ROLE_MAIN, str(i), str(i), world) for i, r in enumerate(ranks)})
            me = Role(ROLE_LAUNCHER)
        else:
            if not single:
                single.append(not any_rank())
            if single[0] and pid in tops and not is_torchrun(pid):
                me = Role(ROLE_MAIN, "0", "0", "1")
            else:
                me = Role(ROLE_LAUNCHER)
        out[pid] = me
        below = pid if me.role == ROLE_MAIN else main
        todo.extend((c, below) for c in reversed(children.get(pid, ())))
    return out


def _below(env: Mapping[str, str], rank_env: Mapping[str, str], rank: Role) -> Role:
    """A process below a rank: that rank's worker, unless it has an identity of its own
    that is neither the rank's inherited environment nor the rank's own numbers (a worker
    started after the rank set its variables in-process carries them)."""
    worker = Role(ROLE_DATALOADER, rank.rank, rank.local_rank, rank.world_size)
    if _signature(env) == _signature(rank_env):
        return worker
    own = _launched_identity(env, rank_env) or rank_from_env(env)
    readings = (own, local_rank_identity(env))  # the rank's numbers, read either way, make it its worker
    if own is None or any(r is not None and (r[0], r[2]) == (rank.rank, rank.world_size) for r in readings):
        return worker
    return Role(ROLE_MAIN, *own)


def _launched_identity(env: Mapping[str, str], parent_env: Mapping[str, str],
                       local_world: str = "") -> tuple[str, str, str] | None:
    """The identity of a process its parent launched with a LOCAL_RANK of its own and no
    RANK (Lightning's children); None otherwise. It wins over an inherited SLURM_PROCID."""
    if "RANK" in env or env.get("LOCAL_RANK") == parent_env.get("LOCAL_RANK"):
        return None
    return local_rank_identity(env, local_world)


def _launched(pid: int, kids: list[int], procs: Mapping[int, Seen]) -> dict[int, Role]:
    """A self-launching rank 0 and the children it launched, or {}: children with
    LOCAL_RANK 1.. (not inherited) and WORLD_SIZE, no RANK. The launcher is local rank 0
    of their world, on their NODE_RANK; the node's rank count is LOCAL_WORLD_SIZE, else
    its highest LOCAL_RANK + 1."""
    env = procs[pid].env
    locals_ = {}
    for kid in kids:
        kid_env = procs[kid].env
        local = kid_env.get("LOCAL_RANK", "")
        if (local.isascii() and local.isdigit() and len(local) <= 9 and int(local) > 0
                and _launched_identity(kid_env, env) is not None):
            locals_[kid] = int(local)
    if not locals_:
        return {}
    first = procs[min(locals_, key=lambda k: (locals_[k], k))].env
    local_world = first.get("LOCAL_WORLD_SIZE") or str(max(locals_.values()) + 1)
    world = first["WORLD_SIZE"]
    found = {pid: Role(ROLE_MAIN, global_rank("0", first.get("NODE_RANK", ""), local_world), "0", world)}
    for kid in locals_:
        identity = _launched_identity(procs[kid].env, env, local_world)
        if identity is not None:
            found[kid] = Role(ROLE_MAIN, *identity)
    return found


def _starts_ranks(env: Mapping[str, str], kids: list[int], procs: Mapping[int, Seen]) -> bool:
    """Whether a process started children with a RANK of their own, neither its RANK nor
    its rank (torchrun, deepspeed's or accelerate's launcher): a launcher, even where it
    carries an identity of its own (``srun torchrun``: SLURM_PROCID is the node's task).
    A rank's worker that carries the RANK its rank set in-process is no such child."""
    own = rank_from_env(env)
    for kid in kids:
        kid_env = procs[kid].env
        if "RANK" in kid_env and kid_env["RANK"] != env.get("RANK") and (
                own is None or (kid_env["RANK"], kid_env.get("WORLD_SIZE", "")) != (own[0], own[2])):
            return True
    return False


def _signature(env: Mapping[str, str]) -> tuple[str | None, ...]:
    return tuple(env.get(v) for v in IDENTITY_VARS)

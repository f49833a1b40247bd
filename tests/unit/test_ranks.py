"""Ranks from any launcher: fixture process trees as each launcher leaves them in /proc.

The environments and command lines are those read from real jobs (torchrun, Lightning's
own launcher, torch.multiprocessing.spawn with spawn and forkserver, DataLoader workers
started by fork, spawn and forkserver); mpirun's, hydra's, deepspeed's and Slurm's are
their documented variables. tests/e2e/test_launchers.py runs the real ones installed here.
"""

from __future__ import annotations

from profagent.target.ranks import MP_FORKSERVER, MP_SPAWN, Role, Seen, classify, started_by

SPAWN_ARGV = ["/venv/bin/python", "-B", "-c",
              "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=4, pipe_handle=6)",
              "--multiprocessing-fork"]
FORKSERVER_ARGV = ["/venv/bin/python", "-B", "-c",
                   "from multiprocessing.forkserver import main; main(8, 9, ['__main__'], **{'sys_path': []})"]
TRACKER_ARGV = ["/venv/bin/python", "-B", "-c", "from multiprocessing.resource_tracker import main;main(3)"]


class Tree:
    """A fixture tree: ``add`` processes in start order; ``roles()`` classifies it."""

    def __init__(self, sigchld: set[int] = frozenset(), torchrun: set[int] = frozenset()) -> None:
        self.procs: dict[int, Seen] = {}
        self.sigchld = set(sigchld)
        self.torchrun = set(torchrun)
        self.asked_sigchld: list[int] = []

    def add(self, pid: int, ppid: int, env: dict[str, str] | None = None, started: str = "") -> int:
        self.procs[pid] = Seen(ppid, 1000.0 + len(self.procs) * 0.001, env or {}, started)
        return pid

    def roles(self) -> dict[int, tuple[str, str, str, str]]:
        def handles(pid: int) -> bool:
            self.asked_sigchld.append(pid)
            return pid in self.sigchld

        got = classify(self.procs, handles, lambda pid: pid in self.torchrun)
        assert list(got) == _tree_order(self.procs)
        return {pid: (r.role, r.rank, r.local_rank, r.world_size) for pid, r in got.items()}


def _tree_order(procs: dict[int, Seen]) -> list[int]:
    out: list[int] = []

    def visit(pid: int) -> None:
        out.append(pid)
        for kid in sorted(p for p, s in procs.items() if s.ppid == pid):
            visit(kid)

    for top in sorted(p for p, s in procs.items() if s.ppid not in procs):
        visit(top)
    return out


LAUNCHER = ("launcher", "", "", "")


def main(rank: str, local: str, world: str) -> tuple[str, str, str, str]:
    return ("main", rank, local, world)


def worker(rank: str, local: str, world: str) -> tuple[str, str, str, str]:
    return ("dataloader", rank, local, world)


def torch_env(rank: int, world: int = 2, local: int | None = None, **more: str) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank if local is None else local), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "none", **more}


def test_torchrun_ranks_and_their_forked_workers() -> None:
    t = Tree()
    t.add(100, 1, {"PATH": "/bin"})
    for r in range(2):
        rank = t.add(110 + r, 100, torch_env(r))
        t.add(120 + 2 * r, rank, torch_env(r))
        t.add(121 + 2 * r, rank, torch_env(r))
    assert t.roles() == {100: LAUNCHER, 110: main("0", "0", "2"), 120: worker("0", "0", "2"),
                         121: worker("0", "0", "2"), 111: main("1", "1", "2"), 122: worker("1", "1", "2"),
                         123: worker("1", "1", "2")}
    assert t.asked_sigchld == []  # nothing started by multiprocessing: no status read


def test_accelerate_launch_is_torchrun_in_process() -> None:
    """``accelerate launch`` runs torch's elastic agent in its own process: its children
    carry RANK, LOCAL_RANK, WORLD_SIZE and ACCELERATE_* variables."""
    t = Tree()
    t.add(200, 1, {"ACCELERATE_USE_CPU": "true"})
    for r in range(2):
        rank = t.add(210 + r, 200, torch_env(r, ACCELERATE_USE_CPU="true", ACCELERATE_MIXED_PRECISION="no"))
        t.add(220 + r, rank, torch_env(r, ACCELERATE_USE_CPU="true", ACCELERATE_MIXED_PRECISION="no"))
    got = t.roles()
    assert got[200] == LAUNCHER and got[210] == main("0", "0", "2") and got[211] == main("1", "1", "2")
    assert got[220] == worker("0", "0", "2") and got[221] == worker("1", "1", "2")


def test_deepspeed_launcher_two_levels() -> None:
    """``deepspeed train.py``: the runner starts ``python -m deepspeed.launcher.launch``,
    which starts the ranks with RANK, LOCAL_RANK, WORLD_SIZE (node 1 of 2, 2 a node)."""
    t = Tree()
    t.add(300, 1)
    t.add(301, 300, {"PDSH_RCMD_TYPE": "ssh"})
    for local in range(2):
        rank = t.add(310 + local, 301, torch_env(2 + local, world=4, local=local, CROSS_RANK="1"))
        t.add(320 + local, rank, torch_env(2 + local, world=4, local=local, CROSS_RANK="1"))
    got = t.roles()
    assert got[300] == got[301] == LAUNCHER
    assert (got[310], got[311]) == (main("2", "0", "4"), main("3", "1", "4"))
    assert (got[320], got[321]) == (worker("2", "0", "4"), worker("3", "1", "4"))


def test_lightning_rank_zero_is_the_launcher_of_rank_one() -> None:
    """Lightning's own launcher: rank 0 sets its variables in-process (its /proc environ
    has none) and starts rank 1 with LOCAL_RANK=1, NODE_RANK, WORLD_SIZE, MASTER_*.
    Rank 0's forked workers show its empty environment; a worker it started with spawn
    shows what it set in-process (LOCAL_RANK=0): both are rank 0's workers."""
    t = Tree(sigchld={400, 410})
    lit = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "53815", "NODE_RANK": "0", "WORLD_SIZE": "2"}
    t.add(400, 1, {"HOME": "/root"})
    t.add(410, 400, {**lit, "LOCAL_RANK": "1"})
    t.add(411, 410, {**lit, "LOCAL_RANK": "1"})
    t.add(412, 410, {**lit, "LOCAL_RANK": "1"})
    t.add(420, 400, {"HOME": "/root"})
    t.add(421, 400, {**lit, "LOCAL_RANK": "0"}, started=MP_SPAWN)
    assert t.roles() == {400: main("0", "0", "2"), 410: main("1", "1", "2"), 411: worker("1", "1", "2"),
                         412: worker("1", "1", "2"), 420: worker("0", "0", "2"), 421: worker("0", "0", "2")}


def test_lightning_on_the_second_node_numbers_ranks_by_node() -> None:
    """num_nodes=2, devices=4: on node 1 the global ranks are 4..7 (NODE_RANK * 4 +
    LOCAL_RANK), the node's rank count taken from its highest LOCAL_RANK + 1."""
    t = Tree()
    t.add(500, 1)
    for local in (1, 2, 3):
        t.add(500 + local, 500, {"LOCAL_RANK": str(local), "NODE_RANK": "1", "WORLD_SIZE": "8"})
    got = t.roles()
    assert got == {500: main("4", "0", "8"), 501: main("5", "1", "8"), 502: main("6", "2", "8"),
                   503: main("7", "3", "8")}


def test_lightning_child_attached_alone_has_its_own_rank() -> None:
    t = Tree()
    t.add(510, 500, {"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"})
    t.add(511, 510, {"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"})
    assert t.roles() == {510: main("1", "1", "2"), 511: worker("1", "1", "2")}


def test_lightning_under_srun_one_task_a_node() -> None:
    """``srun --ntasks-per-node=1`` and Lightning's launcher on each node: the children
    inherit SLURM_PROCID; their own LOCAL_RANK (not inherited) says which rank they are."""
    slurm = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2"}
    t = Tree()
    t.add(600, 1, slurm)
    t.add(601, 600, {**slurm, "LOCAL_RANK": "1", "NODE_RANK": "1", "WORLD_SIZE": "4"})
    t.add(602, 601, {**slurm, "LOCAL_RANK": "1", "NODE_RANK": "1", "WORLD_SIZE": "4"})
    t.add(603, 600, slurm)
    # rank 3's spawned worker, after the rank set a variable of its own in-process
    t.add(604, 601, {**slurm, "LOCAL_RANK": "1", "NODE_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"},
          started=MP_SPAWN)
    assert t.roles() == {600: main("2", "0", "4"), 601: main("3", "1", "4"), 602: worker("3", "1", "4"),
                         604: worker("3", "1", "4"), 603: worker("2", "0", "4")}


def test_mp_spawn_children_are_ranks_in_start_order() -> None:
    """torch.multiprocessing.spawn: the ranks have no variables; the launcher iterates no
    DataLoader (no SIGCHLD handler), its ranks do (their workers are spawned too)."""
    t = Tree(sigchld={711, 712})
    t.add(700, 1)
    t.add(710, 700, started="")  # the resource tracker
    t.add(712, 700, started=MP_SPAWN)  # started first, with the higher PID (PIDs wrap)
    t.add(711, 700, started=MP_SPAWN)
    for w, rank in ((720, 712), (721, 712), (722, 711), (723, 711)):
        t.add(w, rank, started=MP_SPAWN)
    got = t.roles()
    assert got == {700: LAUNCHER, 710: LAUNCHER, 711: main("1", "1", "2"), 722: worker("1", "1", "2"),
                   723: worker("1", "1", "2"), 712: main("0", "0", "2"), 720: worker("0", "0", "2"),
                   721: worker("0", "0", "2")}
    assert 700 in t.asked_sigchld


def test_mp_spawn_with_forkserver() -> None:
    """start_method="forkserver": the ranks are children of the launcher's forkserver, and
    each rank's DataLoader workers children of the rank's own forkserver."""
    t = Tree(sigchld={802, 803, 801})  # forkservers handle SIGCHLD: never read for them
    t.add(800, 1)
    t.add(801, 800, started=MP_FORKSERVER)
    t.add(802, 801, started=MP_FORKSERVER)
    t.add(803, 801, started=MP_FORKSERVER)
    t.add(810, 802, started=MP_FORKSERVER)
    t.add(811, 810, started=MP_FORKSERVER)
    got = t.roles()
    assert got == {800: LAUNCHER, 801: LAUNCHER, 802: main("0", "0", "2"), 810: worker("0", "0", "2"),
                   811: worker("0", "0", "2"), 803: main("1", "1", "2")}


def test_a_single_process_with_spawned_or_forkserver_workers_is_rank_zero() -> None:
    """The same command lines as mp.spawn's ranks, but their parent iterates a DataLoader."""
    for started in (MP_SPAWN, MP_FORKSERVER):
        t = Tree(sigchld={900})
        t.add(900, 1)
        t.add(901, 900)  # the resource tracker
        parent = t.add(902, 900, started=MP_FORKSERVER) if started == MP_FORKSERVER else 900
        t.add(910, parent, started=started)
        t.add(911, parent, started=started)
        got = t.roles()
        assert got[900] == main("0", "0", "1")
        assert {got[p] for p in got if p != 900} == {worker("0", "0", "1")}


def test_a_single_process_with_forked_workers_is_rank_zero() -> None:
    t = Tree()
    t.add(950, 1)
    t.add(951, 950)
    t.add(952, 950)
    assert t.roles() == {950: main("0", "0", "1"), 951: worker("0", "0", "1"), 952: worker("0", "0", "1")}
    assert t.asked_sigchld == []


def test_mpirun_open_mpi_and_hydra() -> None:
    for rank_var, local_var, size_var in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE"),
                                          ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE")):
        t = Tree()
        t.add(1000, 1)  # mpirun / mpiexec
        t.add(1001, 1000)  # orted / hydra_pmi_proxy
        for r in range(2):
            env = {rank_var: str(4 + r), local_var: str(r), size_var: "8"}
            rank = t.add(1010 + r, 1001, env)
            t.add(1020 + r, rank, env)
            # a script that copies its MPI rank into RANK in-process, then starts a spawned worker
            t.add(1030 + r, rank, {**env, "RANK": str(4 + r), "WORLD_SIZE": "8"}, started=MP_SPAWN)
        got = t.roles()
        assert got[1000] == got[1001] == LAUNCHER
        assert (got[1010], got[1011]) == (main("4", "0", "8"), main("5", "1", "8")), rank_var
        assert {got[1020], got[1030]} == {worker("4", "0", "8")}
        assert {got[1021], got[1031]} == {worker("5", "1", "8")}


def test_slurm_tasks() -> None:
    slurm = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"}
    t = Tree()
    t.add(1100, 1, slurm)
    t.add(1101, 1100, slurm)
    assert t.roles() == {1100: main("3", "1", "8"), 1101: worker("3", "1", "8")}


def test_srun_torchrun_the_task_is_the_launcher() -> None:
    """``srun torchrun``: the task carries SLURM_PROCID (the node's task), its children
    their own RANK: it is their launcher, not a rank whose workers they are."""
    slurm = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2"}
    t = Tree()
    t.add(1200, 1, slurm)
    for local in range(2):
        rank = t.add(1210 + local, 1200, {**slurm, **torch_env(2 + local, world=4, local=local)})
        t.add(1220 + local, rank, {**slurm, **torch_env(2 + local, world=4, local=local)})
    got = t.roles()
    assert got[1200] == LAUNCHER
    assert (got[1210], got[1211], got[1220], got[1221]) == (
        main("2", "0", "4"), main("3", "1", "4"), worker("2", "0", "4"), worker("3", "1", "4"))


def test_srun_torchrun_with_one_rank_a_node() -> None:
    """The task's SLURM numbers equal its one rank's: torchrun's command line tells."""
    slurm = {"SLURM_JOB_ID": "43", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1"}
    t = Tree(torchrun={1250})
    t.add(1250, 1, slurm)
    t.add(1251, 1250, {**slurm, **torch_env(0, world=1)})
    t.add(1252, 1251, {**slurm, **torch_env(0, world=1)})
    assert t.roles() == {1250: LAUNCHER, 1251: main("0", "0", "1"), 1252: worker("0", "0", "1")}


def test_hostile_numbers_do_not_break_the_tree() -> None:
    t = Tree()
    t.add(1300, 1)
    t.add(1301, 1300, {"LOCAL_RANK": "9" * 40, "NODE_RANK": "x", "WORLD_SIZE": "2"})
    t.add(1302, 1300, {"LOCAL_RANK": "1", "NODE_RANK": "3", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "-1"})
    got = t.roles()
    assert got[1300] == main("0", "0", "2")  # launched 1302 (1301's LOCAL_RANK is no small number)
    assert got[1302] == main("1", "1", "2")  # the node's count unusable: its local rank
    assert got[1301] == main("9" * 40, "9" * 40, "2")


def test_started_by_reads_multiprocessing_command_lines() -> None:
    assert started_by(SPAWN_ARGV) == MP_SPAWN
    assert started_by(["python3", "-s", "-X", "faulthandler", "-E", *SPAWN_ARGV[2:]]) == MP_SPAWN
    assert started_by(FORKSERVER_ARGV) == MP_FORKSERVER
    assert started_by(TRACKER_ARGV) == ""
    assert started_by(SPAWN_ARGV[:-1]) == ""  # no --multiprocessing-fork: not multiprocessing's
    assert started_by(["python", "train.py", "-c", "conf.yaml"]) == ""
    assert started_by(["python", "-c"]) == "" and started_by([]) == ""


def test_role_defaults() -> None:
    assert Role("launcher") == Role("launcher", "", "", "")


def test_catches_signal_reads_sigcgt(tmp_path) -> None:
    import signal

    from profagent.target.pid import catches_signal

    (tmp_path / "7").mkdir()
    status = tmp_path / "7" / "status"
    status.write_text("Name:\tpython\nSigBlk:\t0000000000000000\nSigIgn:\t0000000001001000\n"
                      "SigCgt:\t0000000100014002\n")  # SIGINT, SIGCHLD (17), 33: a DataLoader's main process
    assert catches_signal(tmp_path, 7, signal.SIGCHLD) and catches_signal(tmp_path, 7, signal.SIGINT)
    status.write_text("SigCgt:\t0000000100000002\n")  # mp.spawn's launcher: SIGINT only
    assert not catches_signal(tmp_path, 7, signal.SIGCHLD)
    status.write_text("SigCgt:\tnot hex\n")
    assert not catches_signal(tmp_path, 7, signal.SIGCHLD)
    assert not catches_signal(tmp_path, 8, signal.SIGCHLD)  # gone

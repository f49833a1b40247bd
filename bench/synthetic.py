"""A large synthetic agent state built from the real snapshot types (for bench/scrape.py)."""

from __future__ import annotations

from collections.abc import Callable

from profagent.contracts import GroupUsage, HostSnapshot, NodeUsage, ProcessInfo, ProcessTree, Usage
from profagent.state import State

RANKS = 8
WORKERS_PER_RANK = 7  # 8 ranks x (1 + 7) = 64 processes
GPUS = 8
FUNCTIONS = 50
JOB = "bench-job"


def synthetic_tree() -> ProcessTree:
    procs = []
    pid = 1000
    for rank in range(RANKS):
        procs.append(ProcessInfo(pid, 999, 1.0, "main", str(rank), str(rank), str(RANKS), f"python train.py --rank {rank}", JOB))
        main_pid = pid
        for _ in range(WORKERS_PER_RANK):
            pid += 1
            procs.append(ProcessInfo(pid, main_pid, 1.0, "dataloader", str(rank), str(rank), str(RANKS), "python train.py", JOB))
        pid += 1
    return ProcessTree(JOB, 999, tuple(procs), True)


def host_snapshot(tick: int) -> HostSnapshot:
    groups = []
    for rank in range(RANKS):
        for role, n in (("main", 1), ("dataloader", WORKERS_PER_RANK)):
            usage = Usage(cpu_user=100.0 + tick, cpu_system=10.0, cpu_iowait=0.5, rss=2 << 30, threads=40,
                          fds=120, read_bytes=1 << 30, write_bytes=1 << 20, ctx_voluntary=1000 + tick,
                          ctx_involuntary=100)
            groups.append(GroupUsage(JOB, str(rank), role, n, usage))
    return HostSnapshot(tuple(groups), NodeUsage(0.5, 1 << 40, 1 << 39, 128))


EXTRA: list[Callable[[ProcessTree, int], tuple[str, object]]] = []


def synthetic_state() -> tuple[State, Callable[[], None], str]:
    """The state, a function that republishes every snapshot (a new version), and a description."""
    state = State()
    tree = synthetic_tree()
    state.set_tree(tree)
    tick = [0]

    def republish() -> None:
        tick[0] += 1
        state.publish("host", host_snapshot(tick[0]), 0.001)
        for make in EXTRA:
            name, snap = make(tree, tick[0])
            state.publish(name, snap, 0.001)

    republish()
    return state, republish, f"{len(tree.processes)} processes, {RANKS} ranks, sources: host" + "".join(
        f", {make(tree, 0)[0]}" for make in EXTRA
    )


def _gpu_maker() -> Callable[[ProcessTree, int], tuple[str, object]]:
    """Real GpuSource ticks over the simulated backend (8 GPUs, one rank per GPU)."""
    from profagent.sources.gpu.nvml import Nvml
    from profagent.sources.gpu.profiles import PROFILES
    from profagent.sources.gpu.simulated import SimulatedNvml
    from profagent.sources.gpu.source import GpuSource

    source = GpuSource(Nvml(SimulatedNvml(PROFILES["h100"], GPUS), simulated=True))
    source.start()

    def make(tree: ProcessTree, tick: int) -> tuple[str, object]:
        return "gpu", source.collect(tree)

    return make


EXTRA.append(_gpu_maker())


def _stacks_maker() -> Callable[[ProcessTree, int], tuple[str, object]]:
    """A stacks snapshot with 50 function series per rank (top_k raised to 50)."""
    from profagent.analysis.stacks import CATEGORIES
    from profagent.contracts import RankStall, StackGroup, StacksSnapshot

    def make(tree: ProcessTree, tick: int) -> tuple[str, object]:
        groups = tuple(
            StackGroup(
                str(rank), "main",
                tuple((c, 1000 + tick + i) for i, c in enumerate(CATEGORIES)),
                tuple((f"function_{i} (module_{i % 7}.py)", 100 * i + tick) for i in range(FUNCTIONS)),
                (("active", "held", 50 + tick), ("idle", "not_held", 200 + tick)),
                job_id=JOB,
            )
            for rank in range(RANKS)
        )
        stalls = tuple(RankStall(str(rank), False, 1.0, JOB) for rank in range(RANKS))
        return "stacks", StacksSnapshot(JOB, groups, stalls, ((JOB, "pyspy_failed", 1),))

    return make


EXTRA.append(_stacks_maker())

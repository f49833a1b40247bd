"""The data contracts: every snapshot a source publishes into ``State``, the process tree
and the typed view readers get. One module on the ground floor (it imports only
``labels``), so every floor above speaks the same types.

Adding a source kind: a frozen dataclass here, and a field of ``StateView`` named like
the source (``docs/ARCHITECTURE.md``, "Adding a source").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType
from typing import Any, Literal

from profagent.labels import shorten

# -- target: where a process runs, the process tree ----------------------------------------
PLACEMENT_LABELS = ("namespace", "pod", "container", "slurm_job_name", "slurm_step", "slurm_task", "slurm_node", "user")


@dataclass(frozen=True)
class Placement:
    namespace: str = ""
    pod: str = ""
    container: str = ""
    slurm_job_name: str = ""
    slurm_step: str = ""
    slurm_task: str = ""
    slurm_node: str = ""
    user: str = ""

    def labels(self) -> tuple[str, ...]:
        """Values in the order of ``PLACEMENT_LABELS``."""
        return tuple(getattr(self, name) for name in PLACEMENT_LABELS)


NOWHERE = Placement()


# Roles: ``main`` (a rank process), ``dataloader`` (any descendant of a rank, attributed
# to it), ``launcher`` (above the ranks, rank "").
ROLE_MAIN = "main"
ROLE_DATALOADER = "dataloader"
ROLE_LAUNCHER = "launcher"


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
    # (job_id, rank) of ranks that exited more than watch.rank_expiry_seconds ago while
    # their job goes on: their series are gone (sources forget them, /metrics leaves them out)
    expired_ranks: frozenset[tuple[str, str]] = frozenset()

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


# -- host source ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Usage:
    """One process' (or one group's) readings. None = not readable here (absent, never 0)."""

    cpu_user: float = 0.0
    cpu_system: float = 0.0
    cpu_iowait: float | None = None
    rss: int = 0
    uss: int | None = None  # DataLoader workers only: memory unique to the process (no shared pages)
    threads: int = 0
    fds: int | None = None
    read_bytes: int | None = None
    write_bytes: int | None = None
    ctx_voluntary: int = 0
    ctx_involuntary: int = 0
    run_queue: float | None = None  # seconds the main thread (of each process) waited for a CPU


@dataclass(frozen=True)
class GroupUsage:
    job_id: str
    rank: str
    role: str
    processes: int
    usage: Usage


@dataclass(frozen=True)
class NodeUsage:
    cpu_ratio: float
    memory_total: int
    memory_available: int
    cpu_count: int


@dataclass(frozen=True)
class HostSnapshot:
    groups: tuple[GroupUsage, ...]
    node: NodeUsage


# -- gpu source ----------------------------------------------------------------------------
@dataclass(frozen=True)
class MigDevice:
    """One MIG device: GPU instance ``gi``, compute instance ``ci``."""

    gi: int
    ci: int
    uuid: str
    name: str
    memory_total: int | None = None
    memory_used: int | None = None
    memory_free: int | None = None


BUSY_THRESHOLD = 0.05  # utilisation above this counts as "busy" for rank_busy()


@dataclass(frozen=True)
class GpuDevice:
    """One physical GPU in one tick. ``values``: see the renderer; absent = not there."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    mig_mode: str
    up: bool
    values: MappingProxyType[str, float] = field(default_factory=lambda: MappingProxyType({}))
    clock_event_reasons: MappingProxyType[str, bool] = field(default_factory=lambda: MappingProxyType({}))
    xid_errors: MappingProxyType[int, int] = field(default_factory=lambda: MappingProxyType({}))
    mig_devices: tuple[MigDevice, ...] = ()
    other_processes: int | None = None


@dataclass(frozen=True)
class ProcessGpuUsage:
    """The processes of one (job, rank, role) on one GPU (or MIG instance)."""

    job_id: str
    rank: str
    role: str
    gpu: int
    uuid: str
    mig: str  # GPU instance id, "" outside MIG
    processes: int
    memory_bytes: int | None
    sm_ratio: float | None
    memory_ratio: float | None


@dataclass(frozen=True)
class GpuSnapshot:
    job_id: str  # the attached job ("" in watch mode: see ProcessGpuUsage.job_id)
    simulated: bool
    driver_version: str
    nvml_version: str
    cuda_version: str
    devices: tuple[GpuDevice, ...]
    processes: tuple[ProcessGpuUsage, ...]

    def rank_busy(self, rank: str, threshold: float = BUSY_THRESHOLD, job_id: str | None = None) -> bool | None:
        """True if a GPU this rank uses shows utilisation above ``threshold``, False if
        all its GPUs are idle, None if unknown (no GPU attributed, or no utilisation).
        ``job_id`` narrows it to one job (watch mode); None = any job."""
        devices = {d.index: d for d in self.devices}
        verdicts: list[bool | None] = []
        for p in self.processes:
            if p.rank != rank or (job_id is not None and p.job_id != job_id):
                continue
            if p.sm_ratio is not None:
                verdicts.append(p.sm_ratio > threshold)
                continue
            dev = devices.get(p.gpu)
            util = dev.values.get("utilization_ratio") if dev is not None and dev.up else None
            verdicts.append(None if util is None else util > threshold)
        if any(v is True for v in verdicts):
            return True
        if verdicts and all(v is False for v in verdicts):
            return False
        return None


# -- stacks source -------------------------------------------------------------------------
@dataclass(frozen=True)
class Frame:
    name: str  # py-spy's qualified name, e.g. "Module._call_impl"
    file: str  # py-spy's short filename, e.g. "torch/nn/modules/module.py"
    line: int

    @property
    def function(self) -> str:
        """The top-K label: ``function (file.py)``, shortened by labels.shorten."""
        label = f"{self.name} ({self.file.rsplit('/', 1)[-1]})"
        return shorten(label)

    def __str__(self) -> str:
        # a native frame (py-spy --native) has no file: its name already reads "symbol (library)"
        return f"{self.name} ({self.file}:{self.line})" if self.file else self.name


@dataclass(frozen=True)
class StackGroup:
    """Cumulative counts of one (rank, role): main-thread samples by category and by leaf
    function (top-K), and all threads' states from periodic dumps."""

    rank: str
    role: str
    categories: tuple[tuple[str, int], ...]
    functions: tuple[tuple[str, int], ...]
    threads: tuple[tuple[str, str, int], ...]  # (state, gil, count)
    job_id: str = ""
    # main-thread samples judged for collective waits (those taken once a native window has
    # taught the rank's wait ratios), and how many of them waited in a collective
    judged: int = 0
    collective_wait: float = 0.0


@dataclass(frozen=True)
class WorkerStall:
    """A DataLoader worker of a rank whose main thread waits for its DataLoader: sampled
    from then on. ``stuck``: it runs the dataset (not waiting for indices) and its stack has
    stood still since its first window."""

    pid: int
    stuck: bool
    unchanged_seconds: float
    frames: tuple[Frame, ...] = ()


@dataclass(frozen=True)
class RankStall:
    """A rank's main thread: whether it is stalled, and where it is now.

    ``frames`` is the main thread's most frequent stack in the last window (root first),
    kept for every rank so the findings can tell the rank that holds a collective up from
    those waiting in it.
    """

    rank: str
    stalled: bool
    unchanged_seconds: float
    job_id: str = ""
    frames: tuple[Frame, ...] = ()
    # the stack has not moved for a whole window: a stall may be starting
    suspected: bool = False
    # the same stack with its native frames, from a native window taken while it stood still
    native: tuple[Frame, ...] = ()
    native_pending: bool = False  # a native window of this stack is asked for and not back yet
    # not stalled, and its last window began before another rank of the job stalled: its
    # stack is from before the job stopped (a long steady window), a newer one is on its way
    stale: bool = False
    # its DataLoader workers, sampled while its main thread waits for the DataLoader
    workers: tuple[WorkerStall, ...] = ()
    workers_pending: bool = False  # it waits for its DataLoader; its workers' first windows are not back
    # seconds from the start of the window ``frames`` come from to this snapshot: a stack
    # older than the moment a rank stopped says where it was before, not where it stands
    window_age_seconds: float = 0.0

    @property
    def stuck_workers(self) -> tuple[WorkerStall, ...]:
        return tuple(w for w in self.workers if w.stuck)


@dataclass(frozen=True)
class StacksSnapshot:
    job_id: str
    groups: tuple[StackGroup, ...]
    stalls: tuple[RankStall, ...]
    errors: tuple[tuple[str, str, int], ...]  # (job_id, reason, failed runs); job "": the snapshot's


# -- traces source (a TraceReport is what analysis.trace.analyze returns) ------------------
@dataclass(frozen=True)
class StepTime:
    name: str
    seconds: float
    breakdown: dict[str, float]  # category -> seconds


@dataclass(frozen=True)
class GpuSummary:
    """Averages over the devices with GPU activity (ratios of the step window)."""

    devices: int
    utilization: float
    idle_ratio: float
    compute_ratio: float
    non_compute_ratio: float
    host_wait_ratio: float
    kernel_wait_ratio: float
    idle_other_ratio: float
    overlap_ratio: float | None
    memcpy_share: float  # of GPU busy time


@dataclass(frozen=True)
class TraceReport:
    path: str
    rank: str | None  # from distributedInfo only; the source may resolve it otherwise
    bytes: int
    accelerator: str | None  # cuda, rocm, mtia, xpu, privateuse1; None: no device work
    steps: tuple[StepTime, ...]  # complete steps only
    steps_inferred: bool
    step_source: str  # profiler_step (ProfilerStep#N), optimizer (Optimizer.step# markers), window
    steps_incomplete: tuple[tuple[str, float], ...]  # (name, seconds): excluded last step
    steps_dropped: int  # ProfilerStep ranges of zero or negative length
    gpu_lag: float | None  # seconds the device ran past the last step's end on its work
    warnings: tuple[str, ...]
    step_mean: float | None
    step_max: float | None
    breakdown: dict[str, float]  # category -> ratio of step time
    gpu: GpuSummary | None
    devices: tuple[dict[str, Any], ...]
    launch_delay: dict[str, float] | None  # seconds: mean, p50, p99, max
    cpu_seconds: float
    gpu_seconds: float
    cpu_gpu_ratio: float | None
    top_ops: tuple[tuple[str, float, int], ...]  # (name, self CPU seconds, calls)
    top_kernels: tuple[tuple[str, float, int], ...]  # (name, GPU seconds, launches)
    annotations: tuple[tuple[str, float, int], ...]  # (name, total seconds, count)
    memory_peak: dict[str, int]  # device -> bytes
    cpu_pids: tuple[int, ...]
    events_dropped: dict[str, int] = field(default_factory=dict)  # left out for their dur: missing, negative, non_finite
    # per top kernel: name, count, total/mean/min/max seconds, launched_by (the ATen op)
    kernel_stats: tuple[dict[str, Any], ...] = ()
    annotation_gpu: dict[str, float] = field(default_factory=dict)  # annotation -> s of GPU work launched inside
    # only with analyze(..., in_steps=True) (profagent diff): every kernel's GPU seconds and
    # every op's self CPU seconds, of those starting inside the steps
    in_steps: dict[str, dict[str, float]] | None = None
    world_size: int | None = None  # distributedInfo
    backend: str | None = None
    started_at: float | None = None  # Unix seconds of the first event (baseTimeNanoseconds + ts), if plausible

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RankTrace:
    rank: str
    report: TraceReport
    ingested_at: float  # wall clock, seconds
    job_id: str = ""  # the job of the traced process (watch mode has several)


@dataclass(frozen=True)
class TracesSnapshot:
    job_id: str
    ranks: tuple[RankTrace, ...]
    counts: tuple[tuple[str, str, int], ...]  # (status, reason, files)
    waiting: int  # files seen but not complete yet
    top_k: int = 10
    user_dirs: bool = True  # a folder the user configured is watched (not only the on-demand folder)
    baseline: tuple[TraceReport, ...] = ()  # traces.baseline, analysed (empty: none configured)


# -- ondemand source -----------------------------------------------------------------------
@dataclass(frozen=True)
class OndemandSnapshot:
    processes: tuple[tuple[str, str, str, int], ...]  # (job_id, rank, role, count) of pollers in the tree
    unmatched: int  # pollers outside the target tree
    datagrams: tuple[tuple[str, int], ...]  # kind -> count (poll, ctxt, malformed, rate_limited)
    requests: tuple[tuple[str, int], ...]  # status -> count (requested, sent, resent, expired)


# -- timeline: steps from kernel probes ---------------------------------------------------
@dataclass(frozen=True)
class RankSteps:
    """One rank's step figures. Totals are counters over the process's life."""

    job_id: str
    rank: str
    pid: int
    optimizer_steps: int
    steps_total: int
    step_seconds_sum: float
    step_buckets: tuple[int, ...]  # per tl.STEP_BUCKETS bound, not cumulative
    stage_seconds: Mapping[str, float]
    backwards_total: int
    collectives_total: int
    window_steps: int  # steps that ended within the window
    p50: float | None
    p90: float | None
    max: float | None
    steps_per_second: float | None
    micro_batches: float | None  # backwards per step over the window
    stage_shares: Mapping[str, float]  # share of the window's step time by stage
    stage_now: str  # data_wait, backward, optimizer, or "" (forward, host work)
    idle_seconds: float | None  # since the rank's last probe event
    since_step_seconds: float | None  # since its last step began (None before the first)
    lag_buckets: tuple[int, ...]  # per tl.LAG_BUCKETS bound
    lag_seconds_sum: float
    lag_count: int
    step_collectives: int = 0  # collectives called since its last step began
    step_boundary: str = ""  # where its steps begin: optimizer, zero_grad, backward, none ("" not known yet)
    steps_note: str = ""  # why its steps are not exact (another boundary, shed events) and what to do
    # probe events lost (a ring was full) where this rank ran: its counts then miss steps
    # and are a floor, not exact
    lost_events: int = 0


@dataclass(frozen=True)
class ArrivalStraggler:
    """The rank of a job whose lags, added up over a step, were the most at most of its
    recent steps (see analysis/timeline.py ``summarize``)."""

    job_id: str
    rank: str
    last_share: float  # of the window's collectives at which it was last
    median_lag: float  # seconds behind the first rank, at the median
    step_lag: float  # its lags of a step added up, at the median over steps
    others_step_lag: float  # the same for the other ranks, their median (they arrive last too, now and then)
    step_seconds: float  # the job's median step time over the window
    collectives: int
    span_seconds: float = 0.0  # from the window's first matched collective to its last
    step_last_share: float = 0.0  # of the window's steps at which its lags added up most
    steps: int = 0  # steps of the window
    step_max_lag: float = 0.0  # its largest lag of a step, at the median step: what the others wait at least


@dataclass(frozen=True)
class ProbedLibrary:
    path: str  # as the process mapped it (bounded)
    build_id: str
    probes: tuple[str, ...]  # events placed
    refused: tuple[str, ...]  # "key: why" for probes not placed


@dataclass(frozen=True)
class TimelineSnapshot:
    ranks: tuple[RankSteps, ...] = ()
    stragglers: tuple[ArrivalStraggler, ...] = ()
    libraries: tuple[ProbedLibrary, ...] = ()
    events_total: int = 0
    events_lost: int = 0
    events_foreign: int = 0  # from processes that are not ranks we observe
    window_seconds: float = 0.0


@dataclass(frozen=True)
class PicturedStep:
    """One step of a rank as the timeline picture shows it; times in seconds on the
    probes' clock of its node (``TimelineHistory.clock_offset`` makes them Unix time)."""

    number: int  # counted from the first step the probes saw of the rank
    start: float
    seconds: float
    stages: Mapping[str, float]  # seconds per tl.STAGES
    backwards: int  # micro-batches
    arrivals: tuple[float, ...]  # its collective calls, in order
    spans: tuple[tuple[str, float, float], ...]  # (stage, begin, end) of its stage blocks


@dataclass(frozen=True)
class RankHistory:
    """A rank's recent steps and the one under way (``current``: its ``seconds`` run to the
    history's ``now``; ``open_stages`` are its blocks not closed yet, as (stage, since))."""

    job_id: str
    rank: str
    pid: int
    node: str
    steps: tuple[PicturedStep, ...]
    current: PicturedStep | None = None
    open_stages: tuple[tuple[str, float], ...] = ()
    last_event: float | None = None


@dataclass(frozen=True)
class TimelineHistory:
    """Every rank's recent steps on one node, for the picture (``/api/timeline``).
    ``clock_offset`` is Unix time minus the probes' clock (CLOCK_MONOTONIC, per node) when
    it was read: adding it puts every node's ranks on one clock."""

    node: str
    now: float
    clock_offset: float
    ranks: tuple[RankHistory, ...] = ()


# -- findings (published by engine/findings.py) --------------------------------------------
SEVERITIES = ("info", "warning", "critical")  # in increasing order
# Every finding kind: the set is closed, each documented in docs/diagnosis.md (a test holds
# them together). A new kind is one line here and its module in analysis/findings/.
FindingKind = Literal[
    "hang",
    "stall",
    "straggler",
    "dataloader_bound",
    "host_sync_bound",
    "optimizer_bound",
    "compile_storm",
    "gpu_idle",
    "memory_leak",
    "gpu_throttled",
    "gpu_errors",
    "duplicate_rank",
]


@dataclass(frozen=True)
class Finding:
    """One active finding. ``rank`` is None for a finding about the whole job.

    ``evidence`` holds JSON-ready numbers and stack lines; ``since`` is the wall-clock
    time (Unix seconds) at which the finding was first seen, kept while it stays active;
    ``advice`` is what to do about it, in a sentence.
    """

    finding: FindingKind
    job_id: str
    rank: str | None
    severity: str
    summary: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    since: float = 0.0
    advice: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.finding, self.job_id, self.rank or "")

    def as_dict(self) -> dict[str, Any]:
        return {
            "finding": self.finding, "job_id": self.job_id, "rank": self.rank,
            "severity": self.severity, "summary": self.summary,
            "evidence": dict(self.evidence), "since": self.since, "advice": self.advice,
        }


@dataclass(frozen=True)
class FindingsSnapshot:
    """Every active finding at one tick (the engine publishes it in State as "findings")."""
    findings: tuple[Finding, ...] = ()
    time: float = 0.0  # wall clock of the evaluation
    # (job_id, rank, share): each rank's main-thread share of time waiting in collectives over
    # the window, for ranks past their warm-up (profagent_collective_wait_ratio)
    wait_shares: tuple[tuple[str, str, float], ...] = ()
    evaluations: int = 0  # ticks evaluated since the engine started (proof that it looked)
    steps: tuple[RankSteps, ...] = ()  # each rank's steps from the kernel probes, as evaluated


# -- incidents (published by engine/incidents/trigger.py) --------------------------------------
@dataclass(frozen=True)
class IncidentsSnapshot:
    counts: tuple[tuple[str, str, int], ...]  # (job_id, kind, incidents captured)
    suppressed: tuple[tuple[str, str, int], ...] = ()  # (job_id, kind, triggers rate-limited)
    rejected: tuple[tuple[str, int], ...] = ()  # (reason, on-demand trace files a capture refused)


# -- the state, as readers see it ---------------------------------------------------------
@dataclass(frozen=True)
class SourceHealth:
    """What the agent knows about one source. ``detail`` says why it is off."""

    up: bool = True
    detail: str = ""
    not_applicable: str = ""  # why an off source has nothing to do here (no_gpu...); "" = a fault
    retrying: str = ""  # why an off source waits and retries by itself (endpoint_held); "" = it does not
    errors: Mapping[str, int] = field(default_factory=dict)
    last_duration: float | None = None
    last_success: float | None = None



@dataclass(frozen=True)
class StateView:
    """A consistent copy of ``State`` taken under its lock; safe to read without it.

    One typed field per published snapshot, named like its source (None: not published,
    or the source is off). ``snapshots`` keeps them all by name for the renderers, which
    go through every source the same way."""

    tree: ProcessTree | None = None
    health: Mapping[str, SourceHealth] = field(default_factory=dict)
    snapshots: Mapping[str, object] = field(default_factory=dict)
    host: HostSnapshot | None = None
    gpu: GpuSnapshot | None = None
    stacks: StacksSnapshot | None = None
    traces: TracesSnapshot | None = None
    ondemand: OndemandSnapshot | None = None
    findings: FindingsSnapshot | None = None
    incidents: IncidentsSnapshot | None = None
    timeline: TimelineSnapshot | None = None

    @classmethod
    def of(cls, snapshots: Mapping[str, object], tree: ProcessTree | None = None,
           health: Mapping[str, SourceHealth] | None = None) -> StateView:
        """The view of snapshots keyed by source name (a name without a field stays in
        ``snapshots`` only: a test source, say)."""
        typed = {name: snap for name, snap in snapshots.items() if name in _TYPED}
        return cls(tree, MappingProxyType(dict(health or {})), MappingProxyType(dict(snapshots)), **typed)


_TYPED = frozenset(f.name for f in fields(StateView)) - {"tree", "health", "snapshots"}

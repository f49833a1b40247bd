"""Series per node for one 8-GPU training job, with the default top-K (docs/cluster.md).

    python bench/series.py [--trace FILE] [--by-family]

The state is built from the real snapshot types and rendered by the agent's own
exposition (the /metrics body), as bench/scrape.py does, but sized like a typical node
rather than a stress case: one job, a torchrun launcher, 8 ranks (one per GPU) each with
2 DataLoader workers, 8 simulated H100s (the real GPU source over the simulated NVML
backend), and the defaults for everything bounded:

- stacks: every category, top_k = 10 functions (+ "other"), all four thread states,
  DataLoader workers not sampled (stacks.dataloader = false);
- traces: every rank's last trace is a real GPU profiler trace (default: the shared
  A100 rank-0 trace) analysed by the real analysis, rendered with traces.top_k = 10;
- ondemand: all 8 ranks polling the Kineto endpoint.

It prints the series (sample lines) per family and the total. Series are counted in the
text format the agent serves to Prometheus: counters are `_total` lines only.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from profagent.analysis.stacks import CATEGORIES
from profagent.contracts import (
    GroupUsage,
    HostSnapshot,
    NodeUsage,
    OndemandSnapshot,
    ProcessInfo,
    ProcessTree,
    RankStall,
    RankTrace,
    StackGroup,
    StacksSnapshot,
    TracesSnapshot,
    Usage,
)
from profagent.exporters.exposition import Exposition
from profagent.sources.gpu.nvml import Nvml
from profagent.sources.gpu.profiles import PROFILES
from profagent.sources.gpu.simulated import SimulatedNvml
from profagent.sources.gpu.source import GpuSource
from profagent.state import State

ROOT = Path(__file__).resolve().parents[1]
# The shared fixtures: $SHARED_FIXTURES_DIR, else the first shared/ walking up from the
# checkout (next to it, or further up for a git worktree); the rule of tests/helpers/paths.py.
SHARED_ENV = "SHARED_FIXTURES_DIR"
SHARED = Path(os.environ[SHARED_ENV]) if os.environ.get(SHARED_ENV) else next(
    (d / "shared" for d in ROOT.parents if (d / "shared").is_dir()), ROOT.parent / "shared")
DEFAULT_TRACE = SHARED / "traces" / "gpu" / "a100-80gb-rank0.pt.trace.json.gz"
RANKS = 8
WORKERS_PER_RANK = 2
GPUS = 8
TOP_K = 10  # stacks.top_k and traces.top_k defaults
JOB = "4242"


def tree() -> ProcessTree:
    procs = [ProcessInfo(999, 1, 1.0, "launcher", "", "", str(RANKS), "python -m torch.distributed.run train.py", JOB)]
    pid = 1000
    for rank in range(RANKS):
        procs.append(ProcessInfo(pid, 999, 1.0, "main", str(rank), str(rank), str(RANKS), "python train.py", JOB))
        main_pid = pid
        for _ in range(WORKERS_PER_RANK):
            pid += 1
            procs.append(ProcessInfo(pid, main_pid, 1.0, "dataloader", str(rank), str(rank), str(RANKS), "python train.py", JOB))
        pid += 1
    return ProcessTree(JOB, 999, tuple(procs), True)


def host() -> HostSnapshot:
    usage = Usage(cpu_user=100.0, cpu_system=10.0, cpu_iowait=0.5, rss=2 << 30, threads=40, fds=120,
                  read_bytes=1 << 30, write_bytes=1 << 20, ctx_voluntary=1000, ctx_involuntary=100)
    groups = [GroupUsage(JOB, "", "launcher", 1, usage)]
    for rank in range(RANKS):
        groups.append(GroupUsage(JOB, str(rank), "main", 1, usage))
        groups.append(GroupUsage(JOB, str(rank), "dataloader", WORKERS_PER_RANK, usage))
    return HostSnapshot(tuple(groups), NodeUsage(0.5, 1 << 40, 1 << 39, 128))


def stacks() -> StacksSnapshot:
    functions = tuple((f"function_{i} (module.py)", 100 + i) for i in range(TOP_K)) + (("other", 5000),)
    threads = tuple((state, gil, 10) for state in ("active", "idle") for gil in ("held", "not_held"))
    groups = tuple(
        StackGroup(str(rank), "main", tuple((c, 100) for c in CATEGORIES), functions, threads, job_id=JOB)
        for rank in range(RANKS)
    )
    stalls = tuple(RankStall(str(rank), False, 1.0, JOB) for rank in range(RANKS))
    return StacksSnapshot(JOB, groups, stalls, ())


def traces(path: Path) -> TracesSnapshot:
    from profagent.analysis.trace.report import analyze
    from profagent.sources.traces.reader import read_trace

    report = analyze(read_trace(path))
    ranks = tuple(RankTrace(str(rank), report, 1.7e9, JOB) for rank in range(RANKS))
    return TracesSnapshot(JOB, ranks, (("ingested", "", RANKS),), 0, top_k=TOP_K)


def ondemand() -> OndemandSnapshot:
    return OndemandSnapshot(
        processes=tuple((JOB, str(rank), "main", 1) for rank in range(RANKS)),
        unmatched=0,
        datagrams=(("poll", 1000), ("ctxt", 8), ("malformed", 0)),
        requests=(("requested", 1), ("sent", 1), ("written", 1), ("expired", 0)),
    )


def source_of(family: str) -> str:
    for prefix, source in (("profagent_trace", "traces"), ("profagent_stack", "stacks"), ("profagent_rank_", "stacks"),
                           ("profagent_gpu", "gpu"), ("profagent_process_gpu", "gpu"), ("profagent_ondemand", "ondemand"),
                           ("profagent_process", "host"), ("profagent_node", "host")):
        if family.startswith(prefix):
            return source
    return "agent"


def count(trace: Path) -> tuple[Counter, str]:
    state = State()
    t = tree()
    state.set_tree(t)
    gpu = GpuSource(Nvml(SimulatedNvml(PROFILES["h100"], GPUS), simulated=True))
    gpu.start()
    try:
        gpu_snap = gpu.collect(t)
    finally:
        gpu.stop()
    for name, snap in (("host", host()), ("gpu", gpu_snap), ("stacks", stacks()),
                       ("traces", traces(trace)), ("ondemand", ondemand())):
        state.publish(name, snap, 0.001)
    body, _ = Exposition(state.view).render("text/plain")
    text = body.decode()
    per_family: Counter = Counter()
    for fam in text_string_to_metric_families(text):
        per_family[fam.name] += sum(1 for s in fam.samples if not s.name.endswith("_created"))
    return per_family, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="GPU profiler trace used for every rank")
    parser.add_argument("--by-family", action="store_true", help="print every family, not only the largest")
    args = parser.parse_args()
    if not args.trace.is_file():
        sys.exit(f"no trace at {args.trace}: pass --trace FILE (a torch profiler GPU trace) or set {SHARED_ENV}")
    per_family, _ = count(args.trace)
    ours = {k: v for k, v in per_family.items() if k.startswith("profagent_")}
    own = sum(v for k, v in per_family.items() if not k.startswith("profagent_"))
    rows = sorted(ours.items(), key=lambda kv: (-kv[1], kv[0]))
    if not args.by_family:
        rows = rows[:15]
    print(f"1 job, {RANKS} ranks x (1 main + {WORKERS_PER_RANK} DataLoader workers) + launcher, "
          f"{GPUS} simulated H100s, top_k {TOP_K}, trace {args.trace.name}")
    print(f"{'family':<55} {'series':>7}")
    for name, n in rows:
        print(f"{name:<55} {n:>7}")
    by_source: Counter = Counter()
    for name, n in ours.items():
        by_source[source_of(name)] += n
    print(f"profagent_* families: {len(ours)}, series: {sum(ours.values())}"
          f" ({', '.join(f'{k} {v}' for k, v in sorted(by_source.items()))})")
    print(f"the agent's own process_*/python_* series: {own}")
    print(f"total series per node: {sum(ours.values()) + own}")


if __name__ == "__main__":
    main()

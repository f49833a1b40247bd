"""Job across nodes: one training job seen whole, from the job-level recording rules.

Every query reads a series recorded by deploy/prometheus/recording.yml (evaluated by
Prometheus, or by Thanos/Mimir above it), never an agent's raw series: no single agent
sees every node, and the rules already did the cross-node aggregation once.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard

from profagent_dashboards.common import (
    BY_KEY,
    NONE,
    PERCENT,
    SECONDS,
    dashboard,
    job_variables,
    q,
    row,
    stat_panel,
    table_panel,
    ts,
)

BOARD = BY_KEY["cluster"]

JOB = 'job_id=~"$job_id"'
STEP = "job_id:profagent_trace_step_seconds"
PROBED = "job_id:profagent_step_window_seconds"
RATIO = "instance_job_id_rank:profagent_trace_step_seconds:ratio_to_job_median"
WAIT = "profagent_collective_wait_ratio"
# A rank waiting 20 points less than its job's median (and the findings' straggler_share).
WAIT_BELOW_STEPS: tuple[tuple[float | None, str], ...] = ((None, "green"), (0.1, "orange"), (0.2, "red"))

# A rank 10 % slower than the job's median is worth a look; 25 % slower costs every other
# rank a quarter of its step in each collective.
STRAGGLER_STEPS: tuple[tuple[float | None, str], ...] = ((None, "green"), (1.1, "orange"), (1.25, "red"))


def build() -> Dashboard:
    d = dashboard(
        BOARD,
        "One training job across all its nodes, from the job-level recording rules "
        "(deploy/prometheus/recording.yml): step time median and max, stragglers, GPU utilisation, "
        "stalled ranks and findings. See docs/cluster.md.",
        job_variables("label_values(job_id:profagent_target_up:nodes, job_id)"),
    )
    d = (
        d.with_row(row("Job"))
        .with_panel(stat_panel(
            "Nodes", NONE, [q(f"job_id:profagent_target_up:nodes{{{JOB}}}", "{{job_id}}", instant=True)],
            "nodes where the job has live processes (job_id:profagent_target_up:nodes)",
        ))
        .with_panel(stat_panel(
            "Ranks with a step time", NONE, [q(f"{STEP}:count{{{JOB}}}", "{{job_id}}", instant=True)],
            "ranks whose last profiler trace gave a step time, on every node; compare with the job's world size",
        ))
        .with_panel(stat_panel(
            "Slowest rank over the median", NONE,
            [q(f"{STEP}:max_ratio_to_median{{{JOB}}}", "{{job_id}}", instant=True)],
            "the worst rank's step time over the job's median step time: 1 = no straggler, 1.5 = one rank "
            "50 % slower than most (the others wait for it in every collective)",
            thresholds=STRAGGLER_STEPS,
        ))
        .with_panel(stat_panel(
            "Stalled ranks", NONE, [q(f"job_id:profagent_rank_stalled:sum{{{JOB}}}", "{{job_id}}", instant=True)],
            "ranks on any node whose main-thread stack is frozen while their GPUs are idle (hung collective, deadlock)",
            thresholds=((None, "green"), (1, "red")),
        ))
        .with_panel(table_panel(
            "Hang: the rank holding the job up (any node)", NONE,
            [q(f"instance_job_id_rank:profagent_hang_rank_info:culprit{{{JOB}}}", instant=True, table_format=True)],
            "each rank that a node's agent found holding the job up in a hang, not in a collective: its node "
            "(instance) and line (location). Empty while no rank is stalled, and during a hang that no node "
            "found a culprit for (every rank waits in a collective: a mismatch or the network); "
            "ProfagentJobHang pages with the same answer, `profagent diagnose --prometheus` prints it",
            width=24, height=5, hide=("Time", "Value", "job", "__name__"),
        ))
        .with_row(row("Steps from the kernel probes (every job, no trace)"))
        .with_panel(ts(
            "Step time: median and slowest rank", SECONDS,
            [q(f"{PROBED}:median{{{JOB}}}", "{{job_id}} median"), q(f"{PROBED}:max{{{JOB}}}", "{{job_id}} slowest")],
            "each rank's median step (one Optimizer.step call to the next, kernel probes on libtorch) over "
            "the agent's window, then the median and the slowest of every rank on every node; see docs/timeline.md",
        ))
        .with_panel(ts(
            "Optimizer steps per second", NONE,
            [q(f"job_id:profagent_optimizer_steps:rate1m_min{{{JOB}}}", "{{job_id}}")],
            "the job's throughput: the slowest rank's optimizer steps per second (a synchronous job steps "
            "together); a drop is a slowdown, zero a stopped job",
        ))
        .with_row(row("Step time across ranks (profiler traces)"))
        .with_panel(ts(
            "Median and max step time", SECONDS,
            [q(f"{STEP}:median{{{JOB}}}", "{{job_id}} median"), q(f"{STEP}:max{{{JOB}}}", "{{job_id}} max")],
            "median and slowest mean step time over every rank of every node (each rank's last trace); "
            "a max far above the median is a straggler",
        ))
        .with_panel(ts(
            "Slowest rank over the median", NONE,
            [q(f"{STEP}:max_ratio_to_median{{{JOB}}}", "{{job_id}}")],
            "the worst rank's step time over the job's median, over time (1 = every rank alike)",
        ))
        .with_panel(table_panel(
            "Stragglers: each rank over the job's median", NONE,
            [q(f"{RATIO}{{{JOB}}}", instant=True, table_format=True),
             q(f"profagent_trace_step_seconds{{{JOB}}}", instant=True, table_format=True)],
            "every rank of every node, slowest first: its mean step time over the job's median "
            "(orange from 1.1, red from 1.25) and the step time itself",
            width=24, height=10, merge=True, hide=("Time", "job"),
            rename={"Value #A": "ratio to median", "Value #B": "step time"},
            overrides={"step time": SECONDS}, coloured={"ratio to median": STRAGGLER_STEPS},
            sort_by="ratio to median",
        ))
        .with_row(row("Straggler: the rank the others wait for"))
        .with_panel(stat_panel(
            "Waits least (below the job's median)", PERCENT,
            [q(f"instance_job_id_rank:{WAIT}:job_straggler{{{JOB}}}", "rank {{rank}} ({{instance}})", instant=True)],
            "the rank that waits least in collectives (native DDP/FSDP frames included), by how many points "
            "below the other ranks' median, once it has been at least 25 points and 30 % below it for 2 "
            "minutes with no rank stalled: in a synchronous job every step lasts as long as the slowest "
            "rank's, so step times are equal and the straggler is the rank that waits least. Also a rank "
            "its node's agent has named the straggler for 30 s (from the collectives' arrivals; 0 % until "
            "its wait share is measured). Held through one noisy evaluation; empty when no rank qualifies "
            "(a healthy job, a hang, a stall)",
            thresholds=WAIT_BELOW_STEPS,
        ))
        .with_panel(ts(
            "Median collective-wait share", PERCENT,
            [q(f"job_id:{WAIT}:median{{{JOB}}}", "{{job_id}}")],
            "the job's median share of main-thread time waiting in collectives; high means the ranks wait "
            "for one of them (or for the network)",
            max_value=1, width=6,
        ))
        .with_panel(table_panel(
            "Each rank below the job's median wait share", PERCENT,
            [q(f"instance_job_id_rank:{WAIT}:below_job_median{{{JOB}}}", instant=True, table_format=True)],
            "every rank of every node: how many points it waits less than the job's median (orange from 0.1, "
            "red from 0.2); the top row is the straggler",
            width=12, height=8, hide=("Time", "job"), rename={"Value": "below median"},
            coloured={"below median": WAIT_BELOW_STEPS}, sort_by="below median",
        ))
        .with_row(row("GPUs and ranks"))
        .with_panel(ts(
            "Job-wide GPU utilisation", PERCENT,
            [q(f"job_id:profagent_gpu_utilization_ratio:avg{{{JOB}}}", "{{job_id}} device"),
             q(f"job_id:profagent_process_gpu_sm_utilization_ratio:avg{{{JOB}}}", "{{job_id}} job's processes (SM)")],
            "device: utilisation of every GPU the job holds memory on, averaged (a GPU shared with another job "
            "counts for both); SM: the job's own per-process SM utilisation, averaged over its GPUs "
            "(absent under MIG and without per-process accounting)",
            max_value=1,
        ))
        .with_panel(ts(
            "Stalled ranks", NONE, [q(f"job_id:profagent_rank_stalled:sum{{{JOB}}}", "{{job_id}}")],
            "ranks of the job stalled at each moment, over every node",
            width=6,
        ))
        .with_panel(ts(
            "Nodes and ranks", NONE,
            [q(f"job_id:profagent_target_up:nodes{{{JOB}}}", "{{job_id}} nodes"),
             q(f"{STEP}:count{{{JOB}}}", "{{job_id}} ranks with a step time")],
            "nodes with live processes and ranks reporting a step time; a drop is a node or rank gone",
            width=6,
        ))
        .with_row(row("Findings"))
        .with_panel(ts(
            "Active findings by severity", NONE,
            [q(f"job_id_severity:profagent_finding:sum{{{JOB}}}", "{{job_id}} {{severity}}")],
            "rank x finding pairs active on any node, by severity (one finding on eight ranks counts eight)",
            stacked=True,
        ))
        .with_panel(table_panel(
            "Findings now", NONE,
            [q(f"job_id_severity:profagent_finding:distinct{{{JOB}}}", instant=True, table_format=True),
             q(f"job_id_severity:profagent_finding:sum{{{JOB}}}", instant=True, table_format=True)],
            "active findings by severity: how many different findings, and on how many ranks in all",
            merge=True, rename={"Value #A": "findings", "Value #B": "rank x finding"},
            sort_by="findings",
        ))
    )
    return d

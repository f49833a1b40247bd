"""Python stacks: what each rank's main thread is doing, its top functions, and stalls."""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard

from profagent_dashboards.common import (
    BY_KEY,
    NONE,
    PER_SECOND,
    PERCENT,
    RANK,
    SECONDS,
    dashboard,
    q,
    row,
    table_panel,
    ts,
)

BOARD = BY_KEY["stacks"]


def category_share(role: str) -> str:
    """Share of a rank's stack samples by category over $__rate_interval (0..1)."""
    samples = f"rate(profagent_stack_samples_total{{{RANK}, {role}}}[$__rate_interval])"
    return (
        f"sum by (job_id, rank, category) ({samples})"
        f" / ignoring (category) group_left () sum by (job_id, rank) ({samples})"
    )


def _function_share() -> str:
    samples = f'increase(profagent_stack_function_samples_total{{{RANK}, role="main"}}[$__range])'
    return (
        f"sort_desc(sum by (job_id, rank, function) ({samples})"
        f" / ignoring (function) group_left () sum by (job_id, rank) ({samples}))"
    )


def build() -> Dashboard:
    d = dashboard(BOARD, "Where the Python main thread of each rank spends its time (py-spy samples).")
    d = (
        d.with_row(row("Where time goes"))
        .with_panel(ts(
            "Rank $rank: main thread by category", PERCENT,
            [q(category_share('role="main"'), "{{category}}")],
            "share of main-thread stack samples by category: dataloader, host_sync, optimizer, backward, "
            "forward, collective, checkpoint_io, compile, idle, other (docs/stacks.md)",
            stacked=True, max_value=1, repeat="rank", width=12,
        ))
        .with_panel(ts(
            "DataLoader workers by category", PERCENT,
            [q(category_share('role="dataloader"'), "rank {{rank}} {{category}}")],
            "share of the DataLoader workers' stack samples by category, per rank",
            max_value=1,
        ))
        .with_panel(ts(
            "Collective-wait share per rank", PERCENT,
            [q(f"profagent_collective_wait_ratio{{{RANK}}}", "rank {{rank}}")],
            "share of each rank's main-thread time waiting in collectives over the findings window, native "
            "frames included (DDP's reducer, Work::wait, gloo, NCCL); absent during warm-up. In a synchronous "
            "job the rank far below the others is the one they wait for (the straggler; docs/diagnosis.md)",
            max_value=1,
        ))
        .with_panel(ts(
            "Stack samples per second", PER_SECOND,
            [q(f"sum by (job_id, rank, role) (rate(profagent_stack_samples_total{{{RANK}}}[$__rate_interval]))",
               "rank {{rank}} {{role}}")],
            "py-spy samples taken per second: the sampling rate actually achieved",
        ))
        .with_row(row("Top functions"))
        .with_panel(table_panel(
            "Top functions (share of the rank's main-thread samples over the time range)", PERCENT,
            [q(_function_share(), instant=True, table_format=True)],
            "leaf functions of the main thread, top-K per rank, the rest in \"other\"",
            width=24, height=10, rename={"Value": "share"}, sort_by="share",
        ))
        .with_row(row("Threads and stalls"))
        .with_panel(ts(
            "Threads by state and GIL", PER_SECOND,
            [q(f"sum by (job_id, rank, state, gil) (rate(profagent_stack_thread_samples_total{{{RANK}}}[$__rate_interval]))",
               "rank {{rank}} {{state}} gil={{gil}}")],
            "Python threads seen in periodic py-spy dumps, per second, by state (active/idle) and GIL",
            width=8,
        ))
        .with_panel(ts(
            "Stalled ranks", NONE, [q(f"profagent_rank_stalled{{{RANK}}}", "rank {{rank}}")],
            "1 while the rank's main-thread stack is unchanged for stacks.stall_seconds and its GPUs are idle",
            width=8, max_value=1,
        ))
        .with_panel(ts(
            "Main-thread stack unchanged for", SECONDS,
            [q(f"profagent_rank_stack_unchanged_seconds{{{RANK}}}", "rank {{rank}}")],
            "how long each rank's main-thread stack has stayed identical",
            width=8,
        ))
    )
    return d

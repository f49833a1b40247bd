"""Stacks source families: samples by category, top-K functions, thread states, stalls."""

from __future__ import annotations

from profagent.contracts import StacksSnapshot
from profagent.exporters.families import Families

GROUP = ("job_id", "rank", "role")


def render(snap: StacksSnapshot, out: Families) -> None:
    samples = out.counter(
        "profagent_stack_samples",
        "main-thread Python stack samples by what they show the process doing (docs/stacks.md)",
        (*GROUP, "category"),
    )
    functions = out.counter(
        "profagent_stack_function_samples",
        "main-thread samples by leaf function, top-K per rank and role, the rest in function=\"other\"",
        (*GROUP, "function"),
    )
    threads = out.counter(
        "profagent_stack_thread_samples",
        "Python threads seen in periodic py-spy dumps, by state (active/idle) and GIL (held/not_held)",
        (*GROUP, "state", "gil"),
    )
    for g in snap.groups:
        labels = [g.job_id or snap.job_id, g.rank, g.role]
        for category, n in g.categories:
            samples.add_metric([*labels, category], n)
        for function, n in g.functions:
            functions.add_metric([*labels, function], n)
        for state, gil, n in g.threads:
            threads.add_metric([*labels, state, gil], n)

    errors = out.counter(
        "profagent_stack_sampler_errors", "failed py-spy runs by reason (a target exiting is not one)",
        ("job_id", "reason"),
    )
    for job_id, reason, n in snap.errors:
        errors.add_metric([job_id or snap.job_id, reason], n)

    stalled = out.gauge(
        "profagent_rank_stalled",
        "1 if the rank's main-thread stack has not changed for stacks.stall_seconds and its GPUs are idle (or unknown)",
        ("job_id", "rank"),
    )
    unchanged = out.gauge(
        "profagent_rank_stack_unchanged_seconds",
        "how long the rank's main-thread stack has stayed identical",
        ("job_id", "rank"),
    )
    for s in snap.stalls:
        stalled.add_metric([s.job_id or snap.job_id, s.rank], 1 if s.stalled else 0)
        unchanged.add_metric([s.job_id or snap.job_id, s.rank], s.unchanged_seconds)

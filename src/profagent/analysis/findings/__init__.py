"""Findings: answers computed from the latest state of every source (pure, no I/O).

A finding (``profagent.contracts.Finding``) says what is wrong with a job or one of its
ranks, how bad it is, and the evidence it rests on. The set of kinds is closed and
documented in docs/diagnosis.md; each analyzer is one module here, run by ``evaluate.py``.
"""

from __future__ import annotations

FINDING_KINDS = (
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
)

"""``memory_leak``: steady growth of a rank's host memory (USS of its DataLoader workers,
RSS of the rank) or of its GPU memory, with the time until it exhausts what is available.

Input: bounded (t, bytes) histories kept by the evaluator (history.MemorySeries) and the
memory still available (node MemAvailable, or the GPU's free memory).
"""

from __future__ import annotations

from profagent.analysis.findings.inputs import AnalysisInputs, Analyzer, MemoryInput
from profagent.config import FindingsConfig
from profagent.contracts import Finding, FindingKind

MIN_R2 = 0.8  # the readings must lie close to a line: a sawtooth (allocator caching) is no leak
# A leak keeps growing: the history's later half and last quarter each grow at this share of
# the whole's rate or more. A start-up that levelled off (torch imported, the model built,
# the allocator's first steps: minutes on a loaded node) lies close to a line too.
RECENT_SHARE = 0.5



def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _duration(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _still_growing(m: MemoryInput, slope: float, cfg: FindingsConfig) -> bool:
    end = m.series.last_time or 0.0
    for part in (2, 4):
        recent = m.series.fit(since=end - m.series.span / part)
        if recent is None or recent[0] < max(cfg.leak_min_rate, RECENT_SHARE * slope):
            return False
    return True


def memory_leak(inputs: list[MemoryInput], cfg: FindingsConfig) -> list[Finding]:
    out: list[Finding] = []
    for m in inputs:
        if m.series.span < cfg.leak_min_span_seconds or m.available is None:
            continue
        fit = m.series.fit()
        if fit is None:
            continue
        slope, r2 = fit
        if slope < cfg.leak_min_rate or r2 < MIN_R2 or not _still_growing(m, slope, cfg):
            continue
        exhaustion = max(m.available, 0.0) / slope
        if exhaustion > cfg.leak_horizon_seconds:
            continue
        severity = "critical" if exhaustion <= cfg.leak_horizon_seconds / 4 else "warning"
        out.append(Finding(
            "memory_leak", m.job_id, m.rank, severity,
            f"{m.what} of rank {m.rank} grows by {_human(slope)}/s; at this rate the "
            f"{'node' if m.kind == 'host' else 'GPU'}'s available memory ({_human(m.available)}) "
            f"runs out in {_duration(exhaustion)}",
            {"kind": m.kind, "bytes": m.series.last, "growth_bytes_per_second": round(slope),
             "r2": round(r2, 3), "available_bytes": m.available,
             "seconds_to_exhaustion": round(exhaustion), "history_seconds": round(m.series.span)},
            advice=("look for tensors kept across steps (a loss appended without .item() or .detach(), "
                    "a growing cache); torch.cuda.memory._record_memory_history shows who allocates"
                    if m.kind != "host" else
                    "look for objects kept across steps (lists of losses or batches, a growing cache); "
                    "tracemalloc or memray show who allocates"),
        ))
    return out


def analyze(inputs: AnalysisInputs) -> list[Finding]:
    return memory_leak(list(inputs.memory), inputs.config)


# What evaluate.py runs of this module, in order; none of its kinds is held by steady.py.
ANALYZERS: tuple[Analyzer, ...] = (analyze,)
WINDOW_HELD: frozenset[FindingKind] = frozenset()

"""An independent reading of a Kineto trace: the reference the analysis is checked against.

``Reference`` reads the raw JSON with the standard library and computes coverage on the
grid of every event boundary with a numpy difference array (no interval merging, no
shared code with profagent). Each elementary segment is then labelled directly.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

PRIORITY = ("kernel", "memcpy", "memset", "communication", "runtime", "dataloader", "cpu_exec")


def raw_trace(path: Path) -> dict:
    """The trace's JSON (.json or .json.gz)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        return json.load(fh)


class Reference:
    """Brute-force figures of one trace."""

    def __init__(self, path: Path) -> None:
        events = [e for e in raw_trace(path)["traceEvents"] if e.get("ph") == "X"]
        gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        device_pids = {e["pid"] for e in gpu}
        # cuda_sync on a GPU stream row is a wait on the device, not a CPU runtime call
        runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                   or (e.get("cat") == "cuda_sync" and e["pid"] not in device_pids)]
        step_events = sorted((e for e in events if e.get("cat") in ("user_annotation", "cpu_op")
                              and str(e.get("name", "")).startswith("ProfilerStep#")),
                             key=lambda e: (e["ts"], -e["dur"]))
        steps: list[tuple[float, float]] = []
        for e in step_events:  # CPU ranges; one inside a kept one is a duplicate or nested
            s, end = e["ts"], e["ts"] + e["dur"]
            if end <= s or (steps and end <= steps[-1][1]):
                continue
            steps.append((max(s, steps[-1][1]) if steps else s, end))
        self.incomplete = []
        if len(steps) >= 2:  # the last step is a stub: see brute_steps in test_traces_steps.py
            marks = [e["ts"] for e in events if e.get("cat") in ("user_annotation", "cpu_op")
                     and e.get("name", "").startswith("Optimizer.step#")]
            has = [any(s <= m < e for m in marks) for s, e in steps]
            durations = [e - s for s, e in steps]
            stub = (not has[-1]) if all(has[:-1]) else durations[-1] < min(durations[:-1]) / 2
            if stub:
                self.incomplete.append(steps.pop())
        self.inferred = not steps
        if steps:
            self.steps = steps
        else:
            kept = [e for e in events if e.get("cat") in
                    ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "cuda_sync",
                     "cpu_op", "user_annotation")]
            self.steps = [(min(e["ts"] for e in kept), max(e["ts"] + e["dur"] for e in kept))]

        def comm(e: dict) -> bool:
            return e["cat"] == "kernel" and ("nccl" in e["name"].lower() or "rccl" in e["name"].lower())

        self.sets = {
            "kernel": [e for e in gpu if e["cat"] == "kernel" and not comm(e)],
            "allkernel": [e for e in gpu if e["cat"] == "kernel"],
            "memcpy": [e for e in gpu if e["cat"] == "gpu_memcpy"],
            "memset": [e for e in gpu if e["cat"] == "gpu_memset"],
            "comm_kernel": [e for e in gpu if comm(e)],
            "gpu": gpu,
            "runtime": runtime,
        }
        cpu_ops = [e for e in events if e.get("cat") == "cpu_op" and not e["name"].startswith("ProfilerStep#")]
        ann = [e for e in events if e.get("cat") == "user_annotation"]
        comm_prefix = ("nccl:", "gloo:", "c10d::", "record_param_comms", "mpi:")
        self.sets["dataloader"] = [e for e in cpu_ops + ann if e["name"].startswith("enumerate(DataLoader)")]
        self.sets["communication"] = self.sets["comm_kernel"] + [
            e for e in cpu_ops + ann if e["name"].startswith(comm_prefix)
            and not e["name"].startswith("enumerate(DataLoader)")]
        self.sets["cpu_exec"] = [e for e in cpu_ops if not e["name"].startswith(("enumerate(DataLoader)", *comm_prefix))]

        points = {p for s in self.steps for p in s}
        for group in self.sets.values():
            for e in group:
                points.add(e["ts"])
                points.add(e["ts"] + e["dur"])
        self.points = np.array(sorted(points))
        self.seg = np.diff(self.points)
        self.window = self._cover([{"ts": s, "dur": e - s} for s, e in self.steps])

    def _cover(self, spans: list[dict]) -> np.ndarray:
        diff = np.zeros(len(self.points) + 1)
        if spans:
            starts = np.searchsorted(self.points, [e["ts"] for e in spans])
            ends = np.searchsorted(self.points, [e["ts"] + e["dur"] for e in spans])
            np.add.at(diff, starts, 1)
            np.add.at(diff, ends, -1)
        return (np.cumsum(diff)[: len(self.seg)] > 0)

    def time(self, mask: np.ndarray) -> float:
        return float(self.seg[mask & self.window].sum())

    def cover(self, name: str) -> np.ndarray:
        return self._cover(self.sets[name])

    def breakdown(self) -> dict[str, float]:
        """Share of the step time of each category, by priority (``other``: the rest)."""
        window = self.time(np.ones_like(self.window))
        left = np.ones_like(self.window)
        shares = {}
        for name in PRIORITY:
            mask = self.cover(name) & left
            shares[name] = self.time(mask) / window
            left &= ~mask
        shares["other"] = self.time(left) / window
        return shares

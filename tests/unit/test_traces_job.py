"""Whole-job analysis of a folder: the per-rank table, the straggler from collectives (not
step time), and the warnings of a set that cannot be one job.

The job is built from the shared 2-GPU NCCL trace copied to four ranks. Rank 2 arrives
late at every collective: its NCCL kernels are short (a fifth of their length), the other
ranks' keep their length (they waited). Rank 0 is given the slowest steps (+10%), which a
step-time rule would name. Each rank's collective time is computed here by brute force
(the union of its NCCL kernels inside its steps, on the reference grid of test_traces_gpu).
"""

from __future__ import annotations

import gzip
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.paths import shared_traces
from unit.test_traces_diff import _load, _write
from unit.test_traces_gpu import Reference

SOURCE = shared_traces() / "a100-2gpu-nccl.pt.trace.json.gz"


def _job(folder: Path, late: int | None, ranks: int = 4, brute_force: bool = True) -> dict[str, float]:
    """Write the job; return each rank's brute-force collective seconds per step (computed
    once per kind of rank: rank 0, the late one, the others), or nothing without
    ``brute_force`` (seconds of CPU for a test that does not check them)."""
    folder.mkdir()
    source = SOURCE.read_bytes()
    expected: dict[str, float] = {}
    by_kind: dict[tuple[bool, bool], float] = {}
    for rank in range(ranks):
        data = json.loads(gzip.decompress(source))
        data["distributedInfo"].update(rank=rank, world_size=ranks)
        for e in data["traceEvents"]:
            if e.get("cat") == "kernel" and "nccl" in e["name"].lower() and rank == late:
                e["dur"] *= 0.2
            if rank == 0 and str(e.get("name", "")).startswith("ProfilerStep#") and e.get("ph") == "X":
                e["dur"] *= 1.1
        path = _write(folder / f"rank{rank}.pt.trace.json.gz", data)
        kind = (rank == 0, rank == late)
        if not brute_force:
            continue
        if kind not in by_kind:
            ref = Reference(path)
            by_kind[kind] = ref.time(ref.cover("comm_kernel")) / len(ref.steps) * 1e-6
        expected[str(rank)] = by_kind[kind]
    return expected


def _analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profagent", "analyze", *args], capture_output=True, text=True,
                          timeout=300, env={"NO_COLOR": "1", "COLUMNS": "160", "PATH": "/usr/bin:/bin"})


@pytest.fixture(scope="module")
def late_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, float]]:
    folder = tmp_path_factory.mktemp("late") / "job"
    return folder, _job(folder, late=2)


def test_late_rank_is_the_straggler_from_its_collectives(late_job: tuple[Path, dict[str, float]]) -> None:
    folder, expected = late_job
    done = _analyze("--json", str(folder))
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)["summary"]
    ranks = summary["ranks"]
    assert set(ranks) == {"0", "1", "2", "3"}
    for rank, seconds in expected.items():
        assert ranks[rank]["collective_seconds"] == pytest.approx(seconds, rel=1e-6)
        for column in ("step_seconds", "compute", "communication", "idle", "overlap"):
            assert ranks[rank][column] is not None
    # rank 0 has the slowest steps, yet the others wait for rank 2
    assert max(ranks, key=lambda k: ranks[k]["step_seconds"]) == "0"
    late = min(expected, key=expected.__getitem__)
    others = statistics.median(v for k, v in expected.items() if k != late)
    assert late == "2" and 1 - expected[late] / others >= summary["threshold"]
    assert summary["straggler_rank"] == "2"
    assert "rank 2's collectives take" in summary["straggler_why"] and "wait for it" in summary["straggler_why"]
    assert summary["warnings"] == []

    text = _analyze(str(folder))
    assert text.returncode == 0, text.stderr
    assert "straggler: rank 2" in text.stdout and "collective ms/step" in text.stdout


def test_equal_collectives_name_no_straggler_whatever_the_step_spread(tmp_path: Path) -> None:
    _job(tmp_path / "job", late=None, brute_force=False)
    summary = json.loads(_analyze("--json", str(tmp_path / "job")).stdout)["summary"]
    assert summary["straggler_rank"] is None
    assert summary["spread"] > 0.02  # rank 0's longer steps (overlaps trimmed): said, not used
    assert "under the 25% threshold" in summary["straggler_why"]


def test_threshold_is_an_option(late_job: tuple[Path, dict[str, float]]) -> None:
    folder, _ = late_job
    summary = json.loads(_analyze("--json", "--straggler-threshold", "0.9", str(folder)).stdout)["summary"]
    assert summary["straggler_rank"] is None and summary["threshold"] == 0.9
    bad = _analyze("--straggler-threshold", "2", str(folder))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_mixed_set_is_said_and_names_no_straggler(tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    folder.mkdir()
    big = _load(shared_traces() / "small-gpu-rank0.pt.trace.json.gz")  # world size 128, April 2023
    _write(folder / "a.pt.trace.json.gz", big)
    two = _load(SOURCE)  # world size 2, May 2024
    two["distributedInfo"]["rank"] = 1
    for e in two["traceEvents"]:
        if e.get("cat") == "kernel" and "nccl" in e["name"].lower():
            e["dur"] *= 0.01  # would be a straggler if the set were one job
    _write(folder / "b.pt.trace.json.gz", two)
    summary = json.loads(_analyze("--json", str(folder)).stdout)["summary"]
    assert summary["straggler_rank"] is None
    assert any("different world sizes (2, 128)" in w for w in summary["warnings"])
    assert any("days apart" in w for w in summary["warnings"])
    assert summary["straggler_why"].startswith("no straggler named: ")

"""The stall warning on a real torchrun job (tests/workloads/timeline_job.py): a
checkpoint save that warns then clears, and a stuck rank named long before a hang. Its own
file: it takes minutes, and xdist runs files side by side."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from helpers.processes import wait_for
from helpers.timeline import Job, attach, findings

pytestmark = [pytest.mark.slow_first, pytest.mark.skipif(os.geteuid() != 0, reason="kernel probes need root")]


def test_a_save_warns_then_clears_and_a_stuck_rank_is_named_four_times_sooner_than_a_hang(tmp_path: Path,
                                                                                          run_agent) -> None:
    """The defaults (a warning at 30 s, a hang at 120 s) scaled down by 2.5 to keep the
    suite short: a warning at 12 s, a hang at 48 s. Rank 0 saves a checkpoint for 25 s
    while rank 1 waits at the barrier: at most a `stall` warning naming the save's line,
    gone once steps resume, never a `hang`. Then rank 1 stops for good in its forward: a
    `stall` naming rank 1 and its line by a quarter of the hang's time."""
    warn_after, hang_after = 12.0, 48.0
    job = Job(tmp_path, 2, "--steps", "100000", "--workers", "0", "--batch", "8", "--save-at-step", "60", "--save-seconds", "25",
              "--hang-at-step", "300")
    try:
        config = tmp_path / "profagent.toml"
        config.write_text(f"[stacks]\nstall_seconds = {hang_after}\n[findings]\nstall_warning_seconds = {warn_after}\n")
        url = attach(run_agent, job, extra=["--config", str(config)])  # stacks on: the lines come from them
        job.start_file.write_text("go")

        def stall() -> dict | None:
            return next((f for f in findings(url)["findings"] if f["finding"] == "stall"), None)

        def stall_at(line: str) -> dict | None:
            found = stall()
            # its line comes from a stack sampled since the rank stopped: absent until one is back
            return found if found and line in found["summary"] else None

        wait_for(lambda: (job.dir / "saving").exists(), 120, interval=0.2, what="the save")
        during = wait_for(lambda: stall_at("save_checkpoint (timeline_job.py:"), warn_after + 10, interval=0.5,
                          what="a stall warning naming the save's line")
        assert during["rank"] == "0", during["summary"]
        wait_for(lambda: (job.dir / "saved1").exists(), 60, interval=0.2, what="the save's end")
        wait_for(lambda: stall() is None, 20, interval=0.5, what="the warning to clear once steps resume")
        hanging = wait_for(lambda: (job.dir / "hanging").exists() and float((job.dir / "hanging").read_text()), 300,
                           interval=0.2, what="rank 1 to stop")
        found = wait_for(lambda: stall_at("stuck_in_forward (timeline_job.py:"), warn_after + 10, interval=0.5,
                         what="a stall naming the stuck rank's line")
        named_after = time.monotonic() - hanging
        assert found["rank"] == "1", found["summary"]
        assert named_after <= hang_after / 4 + 5, named_after
        assert not any(f["finding"] == "hang" for f in findings(url)["findings"])
    finally:
        job.stop()

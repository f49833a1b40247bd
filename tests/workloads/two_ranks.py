"""A 2-rank job for the `top` tests: a torchrun-like launcher and two busy Python ranks.

    python two_ranks.py HANG_FILE

Each rank computes in ``train_step`` forever; rank 1 hangs in ``wait_for_peer`` (the
same stack, forever, like a rank stuck in a collective) once HANG_FILE exists.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from lifeline import bound


def train_step() -> int:
    return sum(i * i for i in range(20000))


def wait_for_peer() -> None:
    while True:
        time.sleep(0.5)


def rank_main(hang_file: Path) -> None:
    rank = os.environ["RANK"]
    while True:
        train_step()
        if rank == "1" and hang_file.exists():
            wait_for_peer()


def launch(hang_file: str) -> int:
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   TORCHELASTIC_RUN_ID=f"top-{os.getpid()}")
        procs.append(subprocess.Popen([sys.executable, __file__, hang_file, "--rank"], env=env))
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    bound(600)  # the launcher dies with the test, each rank with the launcher
    if "--rank" in sys.argv:
        rank_main(Path(sys.argv[1]))
    else:
        sys.exit(launch(sys.argv[1]))

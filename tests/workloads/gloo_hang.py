"""A 2-rank torch/gloo job (run under torchrun) whose rank 1 hangs before all_reduce
while the file named by HANG_FILE exists, and recovers when it is removed.

Each rank appends one line per step to STEPS_DIR/rank<R>.steps, so a test can see it move.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from lifeline import bound


def wait_while_hung(path: str) -> None:
    while os.path.exists(path):
        time.sleep(1.0)  # one unchanged stack: the agent sees a stalled rank


def main() -> None:
    bound(600)  # dies with the launcher, and never outlives a test by much
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hang_file = os.environ["HANG_FILE"]
    steps = os.path.join(os.environ["STEPS_DIR"], f"rank{rank}.steps")
    x = torch.ones(64)
    step = 0
    while True:
        step += 1
        y = (x * step).sum()
        if rank == 1:
            wait_while_hung(hang_file)
        t = torch.tensor([float(y)])
        dist.all_reduce(t)
        with open(steps, "a") as fh:
            fh.write(f"{step} {time.time()}\n")
        time.sleep(0.05)


if __name__ == "__main__":
    main()

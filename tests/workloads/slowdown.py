"""A rank (run under torchrun) whose step time doubles while the file SLOW_FILE exists.

Rank 0 profiles itself (tensorboard_trace_handler into TRACE_DIR, one short window every
~30 steps) and does not poll Kineto; the other ranks poll it (KINETO_USE_DAEMON=1 from
the environment) so the agent can take on-demand traces of them.
"""

from __future__ import annotations

import os
import time

rank = os.environ.get("RANK", "0")
if rank == "0":
    os.environ.pop("KINETO_USE_DAEMON", None)  # read when torch loads: rank 0 never polls

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler  # noqa: E402

STEP_SLEEP = 0.03


def main() -> None:
    torch.set_num_threads(1)
    slow_file = os.environ["SLOW_FILE"]
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    profiler = None
    if rank == "0":
        profiler = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=30, warmup=1, active=3, repeat=0),
                           on_trace_ready=tensorboard_trace_handler(os.environ["TRACE_DIR"], worker_name="rank0"))
        profiler.start()
    launcher = os.getppid()
    while os.getppid() == launcher:  # never outlive the launcher
        loss = model(torch.randn(8, 32)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(STEP_SLEEP * (2 if os.path.exists(slow_file) else 1))
        if profiler is not None:
            profiler.step()


if __name__ == "__main__":
    main()

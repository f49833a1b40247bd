"""A plain DDP job on one GPU, as users write it: two ranks share cuda:0 over gloo (NCCL
refuses two ranks on one device), and torch.profiler traces steps PROF_WAIT+2 .. +4.

Ground truth, one JSON object a line to GT_DIR/rank<R>.jsonl: the rank's PID and, per
step, its time (CUDA-synchronised, prof.step() included) and the memory torch holds.
Rank 0 holds 3 GiB more than rank 1 (a ballast tensor): per-rank GPU memory differs by that.
"""

import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

BALLAST = 3 << 30
WIDTH, BATCH, MICRO = 2048, 4096, 4


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    truth = open(os.path.join(os.environ["GT_DIR"], f"rank{rank}.jsonl"), "a", buffering=1)  # noqa: SIM115

    def note(**event) -> None:
        truth.write(json.dumps({"rank": rank, "pid": os.getpid(), "time": time.time(), **event}) + "\n")

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    ballast = torch.empty(BALLAST, dtype=torch.uint8, device=dev) if rank == 0 else None
    layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)]
    model = DistributedDataParallel(torch.nn.Sequential(*layers).to(dev), device_ids=[0])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(BATCH, WIDTH, device=dev)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    prof = torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=int(os.environ.get("PROF_WAIT", "5")), warmup=2, active=3, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(os.environ["TRACE_DIR"], worker_name=f"rank{rank}"))
    prof.start()
    note(event="ready", ballast=ballast is not None)
    deadline = time.time() + float(os.environ.get("SECONDS_TO_RUN", "40"))
    step = 0
    while time.time() < deadline:
        start = time.perf_counter()
        for _ in range(MICRO):
            model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        prof.step()
        note(event="step", step=step, seconds=time.perf_counter() - start,
             reserved=torch.cuda.memory_reserved(), allocated=torch.cuda.memory_allocated())
        step += 1
    prof.stop()
    note(event="done", steps=step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

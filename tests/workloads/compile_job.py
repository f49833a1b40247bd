"""torch.compile under torchrun DDP (gloo, CPU), for the framework tests (issue #50): the
model compiled (inductor), or its optimizer step (``torch.compile(opt.step)``, where
dynamo drops Optimizer.step's record_function block).

usage: FW_LOG=DIR FW_GO=FILE [FW_TRIGGER=FILE] [FW_MAX_STEPS=N] FW_COMPILE=model|step
       torchrun --nproc-per-node 2 compile_job.py

The ground truth (framework_truth.py): with the model compiled, each step call and block
from hooks on the optimizer; with its step compiled (a hook would be traced into the
graph), the times around the compiled call (a "compiled_step" block: its update is no
stage the probes can see) and each zero_grad call. Each backward and DataLoader wait too; the
test's events are taken at each step's start.
"""

import os
import time

import framework_truth
import torch
import torch.distributed as dist
from lifeline import bound

COMPILE = os.environ.get("FW_COMPILE", "model")


def save_checkpoint(seconds: float) -> None:
    time.sleep(seconds)  # a slow filesystem: every rank writes its shard


def stuck() -> None:
    while True:
        time.sleep(1)  # the user's loop never goes on: the other rank waits in its next collective


def main() -> None:
    bound(framework_truth.MAX_SECONDS)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    truth = framework_truth.Truth(dist.get_rank())
    framework_truth.time_data_waits(truth)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                              torch.nn.ReLU(), torch.nn.Linear(256, 10))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if COMPILE == "model":
        model = torch.compile(model)
        truth.watch_optimizer(opt)
        step = opt.step
    else:
        step = torch.compile(opt.step)
    loader = torch.utils.data.DataLoader(framework_truth.Points(), batch_size=16, num_workers=0)
    truth.wait_for_go()
    max_steps = int(os.environ.get("FW_MAX_STEPS", "100000"))
    for x, y in loader:
        if truth.steps >= max_steps:
            break
        truth.take(save_checkpoint, stuck)
        began = time.monotonic()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        truth.device(began)
        truth.backward_clock(loss)
        loss.backward()
        if COMPILE == "step":
            t0 = time.monotonic()
            truth.steps += 1
            truth.note(event="step", step=truth.steps, time=time.time(), call=t0)
            step()
            # no probe sees inside a compiled step (dynamo drops its record_function): its
            # update is the job's "other" time, logged apart
            truth.block("compiled_step", t0, time.monotonic())
        else:
            step()
        t0 = time.monotonic()
        truth.note(event="zero_grad", call=t0)  # a step boundary where no Optimizer.step block arrives
        opt.zero_grad()
        truth.block("optimizer", t0, time.monotonic())
    truth.note(event="end")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

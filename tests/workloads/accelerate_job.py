"""accelerate as its docs show gradient accumulation: ``Accelerator(gradient_accumulation_steps
=4)`` and ``with accelerator.accumulate(model)`` around each micro-batch, under torchrun
(gloo, CPU), on a small MLP and synthetic data, for the framework tests (issue #50).

usage: FW_LOG=DIR FW_GO=FILE [FW_TRIGGER=FILE] [FW_ACCUM=K] [FW_MAX_STEPS=N]
       torchrun --nproc-per-node 2 accelerate_job.py

The optimizer steps (and zeroes its gradients) once every K micro-batches: accelerate's
wrapper skips the others. The ground truth (framework_truth.py): each step call and
block (hooks on torch's optimizer), its zero_grad, each backward and DataLoader wait; the
test's events are taken at the first micro-batch of each step.
"""

import os
import time

import framework_truth
import torch
from accelerate import Accelerator
from lifeline import bound

ACCUM = int(os.environ.get("FW_ACCUM", "4"))


def save_checkpoint(seconds: float) -> None:
    time.sleep(seconds)  # a slow filesystem: every rank writes its shard


def stuck() -> None:
    while True:
        time.sleep(1)  # the user's loop never goes on: the other rank waits in its next collective


def main() -> None:
    bound(framework_truth.MAX_SECONDS)
    torch.set_num_threads(1)
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    truth = framework_truth.Truth(accelerator.process_index)
    framework_truth.time_data_waits(truth)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(framework_truth.Points(), batch_size=16, num_workers=0)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    truth.watch_optimizer(opt.optimizer)
    truth.wait_for_go()
    max_steps = int(os.environ.get("FW_MAX_STEPS", "100000"))
    for micro, (x, y) in enumerate(loader):
        if micro % ACCUM == 0:
            if truth.steps >= max_steps:
                break
            truth.take(save_checkpoint, stuck)
        with accelerator.accumulate(model):
            began = time.monotonic()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            truth.device(began)
            truth.backward_clock(loss)
            accelerator.backward(loss)
            opt.step()
            if accelerator.sync_gradients:
                t0 = time.monotonic()
                opt.zero_grad()
                truth.block("optimizer", t0, time.monotonic())
    truth.note(event="end")


if __name__ == "__main__":
    main()

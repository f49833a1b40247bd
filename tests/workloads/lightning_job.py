"""PyTorch Lightning started as its docs say: ``python lightning_job.py``, with
``Trainer(accelerator="cpu", devices=2, strategy="ddp")``: Lightning's own launcher starts
rank 1 as a child of this process (gloo). A small MLP on synthetic data, for the framework
tests (issue #50).

usage: FW_LOG=DIR FW_GO=FILE [FW_TRIGGER=FILE] [FW_MAX_STEPS=N] python lightning_job.py

Lightning calls ``optimizer.step(closure)``: the forward, zero_grad and backward run inside
torch's Optimizer.step block. A Callback logs the ground truth (framework_truth.py): each
step call (a pre-hook on the optimizer), the optimizer's own time (the block less the
closure, from training_step's start to on_before_optimizer_step, plus its zero_grad), each
backward (as the engine ran it) and DataLoader wait; it waits for FW_GO in on_train_start
and takes the test's events in on_train_batch_start.
"""

import os
import time

import framework_truth
import pytorch_lightning as pl
import torch
from lifeline import bound

truth: framework_truth.Truth | None = None


def save_checkpoint(seconds: float) -> None:
    time.sleep(seconds)  # a slow filesystem: every rank writes its shard


def stuck() -> None:
    while True:
        time.sleep(1)  # the user's hook never returns: the other rank waits in its next collective


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                          torch.nn.ReLU(), torch.nn.Linear(256, 10))
        self.closure_began = 0.0  # training_step's start: the closure's, inside Optimizer.step
        self.closure_seconds = 0.0
        self.zero_grad_seconds = 0.0

    def training_step(self, batch, batch_idx):
        self.closure_began = began = time.monotonic()
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.layers(x), y)
        truth.device(began)
        truth.backward_clock(loss)
        return loss

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        t0 = time.monotonic()
        optimizer.zero_grad()
        self.zero_grad_seconds = time.monotonic() - t0

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(framework_truth.Points(), batch_size=16, num_workers=0)


class GroundTruth(pl.Callback):
    def setup(self, trainer, pl_module, stage):
        global truth
        truth = framework_truth.Truth(trainer.global_rank)
        framework_truth.time_data_waits(truth)

    def on_train_start(self, trainer, pl_module):
        # the optimizer block less the closure; its zero_grad is the optimizer's own time
        truth.watch_optimizer(trainer.optimizers[0],
                              nested=lambda: pl_module.closure_seconds - pl_module.zero_grad_seconds)
        truth.wait_for_go()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        truth.take(save_checkpoint, stuck)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pl_module.closure_seconds = time.monotonic() - pl_module.closure_began


def main() -> None:
    bound(framework_truth.MAX_SECONDS)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=int(os.environ.get("FW_MAX_STEPS", "100000")),
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=[GroundTruth()])
    trainer.fit(Net())
    truth.note(event="end")


if __name__ == "__main__":
    main()

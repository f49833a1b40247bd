"""Hugging Face ``Trainer`` as its docs show it, on a 2-layer GPT-2 built from a config
(no download) and synthetic tokens, for the framework tests (issue #50).

usage: FW_LOG=DIR FW_GO=FILE [FW_TRIGGER=FILE] [FW_ACCUM=K] [FW_MAX_STEPS=N]
       torchrun --nproc-per-node 2 hf_trainer_job.py

A TrainerCallback waits for FW_GO before the first step, takes the test's events at each
step's beginning (framework_truth.py: straggle, a 60 s checkpoint pause on every rank in
``save_checkpoint``, a hang in ``stuck``) and hooks the optimizer's step: each call and
its block go to FW_LOG/rank<R>.jsonl with each DataLoader wait and backward.
"""

import os
import tempfile
import time

import framework_truth
import torch
from lifeline import bound
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

ACCUM = int(os.environ.get("FW_ACCUM", "1"))
truth = framework_truth.Truth(framework_truth.rank())


class Model(GPT2LMHeadModel):
    """GPT-2 whose forward waits on its device, and whose loss's backward is clocked."""

    def forward(self, *args, **kwargs):
        began = time.monotonic()
        out = super().forward(*args, **kwargs)
        truth.device(began)
        truth.backward_clock(out.loss)
        return out


def save_checkpoint(seconds: float) -> None:
    time.sleep(seconds)  # a slow filesystem: every rank writes its shard


def stuck() -> None:
    while True:
        time.sleep(1)  # the user's callback never returns: the other rank waits in its next collective


class GroundTruth(TrainerCallback):
    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds torch's
        truth.watch_optimizer(inner)
        truth.wait_for_go()

    def on_step_begin(self, args, state, control, **kwargs):
        truth.take(save_checkpoint, stuck)


def main() -> None:
    bound(framework_truth.MAX_SECONDS)
    torch.set_num_threads(1)
    framework_truth.time_data_waits(truth)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
    torch.manual_seed(0)
    model = Model(config)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-trainer-"), max_steps=int(os.environ.get("FW_MAX_STEPS", "100000")),
        per_device_train_batch_size=4, gradient_accumulation_steps=ACCUM, learning_rate=1e-4,
        logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True, ddp_backend="gloo",
        dataloader_num_workers=0, disable_tqdm=True, seed=0, remove_unused_columns=False,
        ddp_find_unused_parameters=False)
    trainer = Trainer(model=model, args=args, train_dataset=framework_truth.Tokens(config.vocab_size, 32),
                      callbacks=[GroundTruth()])
    trainer.train()
    truth.note(event="end")


if __name__ == "__main__":
    main()

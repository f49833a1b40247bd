"""Tiny CPU jobs started by real launchers, for tests/e2e/test_launchers.py.

``python launchers.py lightning OUT``: PyTorch Lightning's own launcher (Trainer with
accelerator="cpu", devices=2, strategy="ddp": rank 0 starts rank 1 as its child).
``python launchers.py spawn OUT``: torch.multiprocessing.spawn of 2 ranks (gloo).
``python launchers.py accelerate OUT``: the script ``accelerate launch`` runs.
Each rank iterates a DataLoader with 2 persistent workers (forked; Lightning's rank 0's
started as LAUNCHERS_RANK0_WORKERS says), writes
``OUT/rankR.json`` (its rank and world from the framework, its PID and its workers'
PIDs) once its workers exist, then keeps stepping until ``OUT/stop`` exists.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

STEP_SLEEP = 0.05  # a step's host wait: the test needs ranks that live, not CPU


class Numbers(Dataset):
    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randn(1, generator=g)


def loader() -> DataLoader:
    # LAUNCHERS_RANK0_WORKERS: how Lightning's rank 0 (the process started without
    # LOCAL_RANK) starts its workers: spawned ones carry the variables it set in-process
    start = None if "LOCAL_RANK" in os.environ else os.environ.get("LAUNCHERS_RANK0_WORKERS") or None
    return DataLoader(Numbers(), batch_size=4, num_workers=2, persistent_workers=True, multiprocessing_context=start)


def report(out: Path, rank: int, world: int) -> None:
    kids = [int(p) for t in os.listdir(f"/proc/{os.getpid()}/task")
            for p in Path(f"/proc/{os.getpid()}/task/{t}/children").read_text().split()]
    tmp = out / f".rank{rank}.json"
    tmp.write_text(json.dumps({"rank": rank, "world": world, "pid": os.getpid(), "workers": kids}))
    tmp.rename(out / f"rank{rank}.json")


def stopped(out: Path) -> bool:
    return (out / "stop").exists()


def lightning(out: Path) -> None:
    import pytorch_lightning as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx == 2:
                report(out, self.global_rank, self.trainer.world_size)
            if self.trainer.strategy.reduce_boolean_decision(stopped(out), all=False):
                self.trainer.should_stop = True  # every rank at the same step
            time.sleep(STEP_SLEEP)
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=100_000, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), loader())


def _steps(out: Path, rank: int, world: int) -> None:
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, (x, y) in enumerate(loader()):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if step == 2:
            report(out, rank, world)
        flag = torch.tensor([float(stopped(out))])
        dist.all_reduce(flag)
        if flag.item():
            break
        time.sleep(STEP_SLEEP)


def spawned_rank(rank: int, world: int, out: Path, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _steps(out, rank, world)
    dist.destroy_process_group()


def accelerated(out: Path) -> None:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    _steps(out, acc.process_index, acc.num_processes)


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    if mode == "lightning":
        lightning(out)
    elif mode == "spawn":
        import torch.multiprocessing as mp

        mp.spawn(spawned_rank, args=(2, out, sys.argv[3]), nprocs=2)
    elif mode == "accelerate":
        accelerated(out)
    else:
        raise SystemExit(f"unknown mode {mode!r}: lightning, spawn or accelerate")


if __name__ == "__main__":
    main()

"""A 2-rank CPU DDP training loop (gloo) for the findings tests, run under torchrun.

usage: torchrun --nproc-per-node 2 train_ddp.py MODE [--steps N]
MODE: hang (rank 1 sleeps before its all_reduce), straggler (rank 1 sleeps 0.1 s each step),
slow_loader (__getitem__ sleeps), leak (rank 0 keeps 2 MiB per step, about 8 MiB/s, up to
LEAK_CAP_BYTES), healthy.

Every rank is bounded (lifeline.bound): it dies with the launcher and after MAX_SECONDS
(env TRAIN_DDP_MAX_SECONDS), whatever the mode.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from lifeline import bound

MAX_SECONDS = int(os.environ.get("TRAIN_DDP_MAX_SECONDS", "300"))
LEAK_CAP_BYTES = 1 << 30  # the leak stops growing here: enough for any detector, harmless to the node
LEAK_STEP_BYTES = 2 << 20

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["hang", "straggler", "slow_loader", "leak", "healthy"])
parser.add_argument("--steps", type=int, default=100000)
args = parser.parse_args()


class Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int):
        if args.mode == "slow_loader":
            time.sleep(0.02)  # a slow decode: the main thread waits for the loader
        return torch.randn(32), torch.randint(0, 4, ()).item()


def main() -> None:
    bound(MAX_SECONDS)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(Data(), batch_size=16)
    kept = []
    print(f"rank {rank} ready", flush=True)
    for step, (x, y) in enumerate(loader):
        if step >= args.steps:
            break
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if args.mode == "hang" and rank == 1 and step == 20:
            print("rank 1 hangs", flush=True)
            time.sleep(3600)  # the culprit: never reaches the all_reduce below
        if args.mode == "straggler" and rank == 1:
            time.sleep(0.1)
        if args.mode == "leak" and rank == 0 and len(kept) * LEAK_STEP_BYTES < LEAK_CAP_BYTES:
            kept.append(bytearray(os.urandom(1 << 10) * (LEAK_STEP_BYTES >> 10)))  # never freed
        t = torch.ones(1)
        dist.all_reduce(t)
        if args.mode == "leak":
            time.sleep(0.25)  # paced: the 1 GiB cap is reached after about two minutes, not seconds
        if args.mode == "healthy":
            time.sleep(0.01)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A 2-rank CPU DDP training loop (gloo) for the findings tests, run under torchrun.

usage: torchrun --nproc-per-node 2 train_ddp.py MODE [--steps N]
MODE: hang (rank 1 sleeps before its all_reduce), straggler (rank 1 sleeps 0.1 s each step),
slow_loader (__getitem__ sleeps), leak (rank 0 keeps 2 MiB per step), healthy.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

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
        if args.mode == "leak" and rank == 0:
            kept.append(bytearray(os.urandom(1 << 10) * (2 << 10)))  # 2 MiB a step, never freed
        t = torch.ones(1)
        dist.all_reduce(t)
        if args.mode in ("leak", "healthy"):
            time.sleep(0.01)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

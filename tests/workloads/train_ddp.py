"""A 2-rank CPU DDP training loop (gloo) for the findings tests, run under torchrun.

usage: torchrun --nproc-per-node 2 train_ddp.py MODE [--steps N]
MODE: hang (rank 1 sleeps before its all_reduce), straggler (rank 1 sleeps 0.1 s each step),
slow_loader (__getitem__ sleeps), leak (rank 0 keeps 2 MiB per step), healthy.
"""

import argparse
import ctypes
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["hang", "straggler", "slow_loader", "leak", "healthy"])
parser.add_argument("--steps", type=int, default=100000)
parser.add_argument("--max-seconds", type=float, default=600.0)
args = parser.parse_args()

LEAK_CAP = 3 << 30  # the leak stops growing here: a test must never exhaust the machine


def bound_lifetime() -> None:
    """Die with the launcher (torchrun puts ranks in their own sessions) and after a while."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the launcher is already gone
        os._exit(1)
    threading.Timer(args.max_seconds, os._exit, (1,)).start()


class Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int):
        if args.mode == "slow_loader":
            time.sleep(0.02)  # a slow decode: the main thread waits for the loader
        return torch.randn(32), torch.randint(0, 4, ()).item()


def main() -> None:
    bound_lifetime()
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
        if args.mode == "leak" and rank == 0 and len(kept) * (2 << 20) < LEAK_CAP:
            kept.append(bytearray(os.urandom(1 << 10) * (2 << 10)))  # 2 MiB a step, never freed
        t = torch.ones(1)
        dist.all_reduce(t)
        if args.mode == "leak":
            time.sleep(0.05)  # ~30 MiB/s: the cap is reached after about 100 s
        elif args.mode == "healthy":
            time.sleep(0.01)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

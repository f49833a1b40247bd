"""A DDP training job (gloo, CPU) written the way users write it: a small CNN, a map-style
dataset of synthetic images, DistributedSampler, a DataLoader with worker processes, AdamW.
It stops in one of the ways real jobs stop, for the hang findings.

usage: FAILMODES_LOG=DIR torchrun --nproc-per-node 2 failmodes.py MODE
(positional only: torchrun's own parser would take an abbreviated --option)
MODE:
  worker_hang  rank 0's DataLoader worker sleeps for ever in ``__getitem__`` once it is
               asked for sample HANG_INDEX: rank 0 waits for its DataLoader, rank 1 in
               backward's all_reduce (DDP's reducer);
  uneven       rank 0 has UNEVEN_BATCHES batches, rank 1 one more: rank 0 ends its loop
               and waits in ``dist.barrier()``, rank 1 in its extra batch's backward;
  spin         rank 1 spins in a pure-Python loop at one line before its forward of step
               SPIN_STEP: rank 0 waits in backward's all_reduce.

Ground truth goes to DIR/rank<R>.jsonl (one JSON object a line): {"event": "ready", "pid"},
{"event": "step", "step"}, and the event itself with its file and line: {"event":
"worker_hang", "pid" (the worker's), "line"}, {"event": "barrier", "line"}, {"event":
"extra_batch", "line"} (the line of its backward), {"event": "spin", "line"}. Every
process is bounded (lifeline.bound; a worker dies with its rank).
"""

import argparse
import inspect
import json
import os
import time

import torch
import torch.distributed as dist
from lifeline import bound
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

MAX_SECONDS = int(os.environ.get("FAILMODES_MAX_SECONDS", "300"))
LOG_DIR = os.environ.get("FAILMODES_LOG", ".")
BATCH = 4
# An even index, so in rank 0's shard (DistributedSampler, no shuffle), at its step 600: some
# seconds of training first, so that the agent's window is not mostly the first batch's wait.
HANG_INDEX = 2 * BATCH * 600
UNEVEN_BATCHES = 12  # rank 0's batches in `uneven`; rank 1 has one more
SPIN_STEP = 8
FILE = os.path.basename(__file__)

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["worker_hang", "uneven", "spin"])
args = parser.parse_args()


def here() -> int:
    return inspect.currentframe().f_back.f_lineno


class Log:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.path = os.path.join(LOG_DIR, f"rank{rank}.jsonl")

    def note(self, **event) -> None:
        with open(self.path, "a") as fh:  # one write a line, from the rank or its worker
            fh.write(json.dumps({"rank": self.rank, "time": time.time(), **event}) + "\n")


class SyntheticImages(Dataset):
    """Images of 3x16x16 and a class, made from the index (the same on every epoch)."""

    def __init__(self, n: int, rank: int, hang: bool) -> None:
        self.n, self.rank, self.hang = n, rank, hang

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        g = torch.Generator().manual_seed(index)
        if self.hang and index == HANG_INDEX:
            Log(self.rank).note(event="worker_hang", pid=os.getpid(), file=FILE, line=here() + 1)
            time.sleep(3600)  # the hung worker: a read that never returns
        return torch.randn(3, 16, 16, generator=g), index % 10


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.head = torch.nn.Linear(8 * 16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1))


def spin_forever() -> None:
    n = 0
    while n >= 0: n += 1  # noqa: E701  (one line: the culprit spins at it)


def main() -> None:
    bound(MAX_SECONDS)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = Log(rank)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(Net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args.mode == "uneven":
        # each rank its own count of samples: rank 0 runs out of batches one step early
        data = SyntheticImages(BATCH * (UNEVEN_BATCHES + rank), rank, hang=False)
        sampler = None
    else:
        data = SyntheticImages(100_000, rank, hang=args.mode == "worker_hang" and rank == 0)
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=2)
    log.note(event="ready", pid=os.getpid())
    step = 0
    for x, y in loader:
        if args.mode == "spin" and rank == 1 and step == SPIN_STEP:
            log.note(event="spin", file=FILE, line=inspect.getsourcelines(spin_forever)[1] + 2)
            spin_forever()
        if args.mode == "uneven" and rank == 1 and step == UNEVEN_BATCHES:
            log.note(event="extra_batch", file=FILE, line=here() + 2)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        log.note(event="step", step=step)
    log.note(event="barrier", file=FILE, line=here() + 1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

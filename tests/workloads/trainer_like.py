"""A DDP loop shaped as HF ``Trainer``'s, in plain torch (gloo, CPU), for the straggler tests:
at the start of every step each rank gathers its batch's item count from every rank (the
Trainer's ``num_items_in_batch``), which re-aligns the ranks before the forward; then the
forward and a backward with about ten DDP bucket all_reduces; then the host waits on its
device (a sleep) and the optimizer steps.

usage: torchrun --nproc-per-node N trainer_like.py --truth-dir DIR --go-file FILE
       [--seconds S] [--no-gather] [--device-seconds S] [--slow-rank R] [--slow-factor F]
       [--straggle-file FILE] [--slow-loader-rank R] [--loader-seconds S] [--workers W]
       [--linger S]

It waits for FILE before its first step, so an agent can place its probes first.
--slow-rank's device takes --slow-factor times as long (from the first step, or once
--straggle-file exists): late at the next step's gather, a coin toss at the buckets after
it. --no-gather leaves the gather out (plain DDP: the straggler is late at every bucket; the
ranks agree to stop every 100 steps).
--slow-loader-rank's DataLoader workers take --loader-seconds more a sample.
Each rank writes DIR/rankR.json: every optimizer.step() call's time (a step pre-hook),
per step its DataLoader wait and device seconds, and when its straggling began.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from lifeline import bound

parser = argparse.ArgumentParser()
parser.add_argument("--truth-dir", required=True)
parser.add_argument("--go-file", required=True)
parser.add_argument("--seconds", type=float, default=60.0)
parser.add_argument("--no-gather", action="store_true")
parser.add_argument("--device-seconds", type=float, default=0.04)
parser.add_argument("--slow-rank", type=int, default=-1)
parser.add_argument("--slow-factor", type=float, default=1.5)
parser.add_argument("--straggle-file", default="")
parser.add_argument("--slow-loader-rank", type=int, default=-1)
parser.add_argument("--loader-seconds", type=float, default=0.0)
parser.add_argument("--workers", type=int, default=1)
parser.add_argument("--linger", type=float, default=0.0)
args = parser.parse_args()
RANK = int(os.environ["RANK"])
WIDTH, LAYERS, BATCH = 256, 10, 16
BUCKET_MB = WIDTH * (WIDTH + 1) * 4 / 2**20  # a layer's gradients a bucket: ten bucket all_reduces


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int):
        if args.slow_loader_rank == RANK:
            time.sleep(args.loader_seconds)  # a slow decode on this rank's workers only
        return torch.randn(WIDTH), torch.randint(0, 10, ()).item()


def main() -> None:
    bound(int(300 + args.seconds + args.linger))
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    layers = [m for _ in range(LAYERS) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())]
    net = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers), bucket_cap_mb=BUCKET_MB)
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    loader = iter(torch.utils.data.DataLoader(Samples(), batch_size=BATCH, num_workers=args.workers))
    calls: list[float] = []
    opt.register_step_pre_hook(lambda *_: calls.append(time.monotonic()))
    steps: list[dict[str, float]] = []
    while not Path(args.go_file).exists():
        time.sleep(0.05)
    dist.barrier()
    straggling_since = None
    until = time.monotonic() + args.seconds
    while True:
        done = torch.tensor([1.0 if time.monotonic() >= until else 0.0])
        t0 = time.monotonic()
        x, y = next(loader)
        data = time.monotonic() - t0
        if not args.no_gather:
            # the Trainer's gather of the batch's item count (with done: every rank ends at one step)
            counts = [torch.zeros(2) for _ in range(world)]
            dist.all_gather(counts, torch.tensor([float(len(y)), done.item()]))
            if max(c[1].item() for c in counts):
                break
        loss = torch.nn.functional.cross_entropy(net(x)[:, :10], y)
        loss.backward()
        straggling = args.slow_rank == RANK and (not args.straggle_file or os.path.exists(args.straggle_file))
        if straggling and straggling_since is None:
            straggling_since = time.monotonic()
        device = args.device_seconds * (args.slow_factor if straggling else 1.0)
        time.sleep(device)  # the device computes; the host waits for it
        opt.step()
        opt.zero_grad()
        steps.append({"data_wait": data, "device": device})
        if args.no_gather and len(steps) % 100 == 0:  # a collective of its own only every 100 steps
            dist.all_reduce(done, op=dist.ReduceOp.MAX)
            if done.item():
                break
    Path(args.truth_dir, f"rank{RANK}.json").write_text(json.dumps(
        {"calls": calls, "steps": steps, "straggling_since": straggling_since, "pid": os.getpid()}))
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(args.linger)


if __name__ == "__main__":
    main()

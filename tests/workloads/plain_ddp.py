"""A CPU training job (gloo) written the way users write it, for the collective findings:
plain DDP (``ddp``) or FSDP2 (``fsdp``, ``torch.distributed.fsdp.fully_shard``),
with no Python-level collective in the loop: ranks meet only inside ``backward()``
(DDP's C++ reducer, FSDP's hooks).

usage: PLAIN_DDP_LOG=DIR torchrun --nproc-per-node N plain_ddp.py MODE [ddp|fsdp]
(positional only: torchrun's own parser would take an abbreviated --option)
MODE:
  healthy     every rank trains at the same pace;
  hang        rank 1 sleeps before its forward at step HANG_STEP (the culprit's line is logged);
  straggler   rank SLOW_RANK does twice the compute of the others each step;
  mismatch    at step HANG_STEP rank 0 enters all_reduce, rank 1 broadcast (they never meet).

Ground truth goes to DIR/rank<R>.jsonl (one JSON object a line): {"event": "ready"},
{"event": "step", "step", "seconds"} and {"event": "hang"|"mismatch", "file", "line",
"collective"}. Every rank is bounded (lifeline.bound).
"""

import argparse
import inspect
import json
import os
import time

import torch
import torch.distributed as dist
from lifeline import bound

MAX_SECONDS = int(os.environ.get("PLAIN_DDP_MAX_SECONDS", "400"))
HANG_STEP = int(os.environ.get("PLAIN_DDP_HANG_STEP", "30"))
SLOW_RANK = int(os.environ.get("PLAIN_DDP_SLOW_RANK", "1"))
WORK = 6  # matmuls per forward; the straggler does 2 x WORK

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["healthy", "hang", "straggler", "mismatch"])
parser.add_argument("wrap", nargs="?", choices=["ddp", "fsdp"], default="ddp")
args = parser.parse_args()
LOG_DIR = os.environ.get("PLAIN_DDP_LOG", ".")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(2))

    def forward(self, x: torch.Tensor, repeat: int) -> torch.Tensor:
        for _ in range(repeat):
            for layer in self.layers:
                x = torch.tanh(layer(x))
        return x.sum()


def here() -> int:
    return inspect.currentframe().f_back.f_lineno


def main() -> None:
    bound(MAX_SECONDS)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    log = open(os.path.join(LOG_DIR, f"rank{rank}.jsonl"), "a", buffering=1)  # noqa: SIM115

    def note(**event) -> None:
        log.write(json.dumps({"rank": rank, "time": time.time(), **event}) + "\n")

    torch.manual_seed(0)
    net = Net()
    if args.wrap == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for layer in net.layers:
            fully_shard(layer)
        model = fully_shard(net)
    else:
        model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    repeat = 2 * WORK if args.mode == "straggler" and rank == SLOW_RANK else WORK
    note(event="ready")
    step = 0
    while True:
        began = time.monotonic()
        x = torch.randn(64, 256)
        if args.mode == "hang" and rank == 1 and step == HANG_STEP:
            note(event="hang", file=os.path.basename(__file__), line=here() + 1)
            time.sleep(3600)  # the culprit: never reaches its forward, the others wait in backward
        if args.mode == "mismatch" and step == HANG_STEP:
            t = torch.ones(1)
            if rank == 0:
                note(event="mismatch", file=os.path.basename(__file__), line=here() + 1, collective="all_reduce")
                dist.all_reduce(t)
            else:
                note(event="mismatch", file=os.path.basename(__file__), line=here() + 1, collective="broadcast")
                dist.broadcast(t, src=1)
        loss = model(x, repeat)
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        note(event="step", step=step, seconds=time.monotonic() - began)


if __name__ == "__main__":
    main()

"""A CPU training job (gloo) written the way users write it, for the collective findings:
plain DDP (``ddp``) or FSDP2 (``fsdp``, ``torch.distributed.fsdp.fully_shard``), with no
Python-level collective in the loop: ranks meet only inside forward/backward (DDP's C++
reducer, FSDP2's hooks).

usage: PLAIN_DDP_LOG=DIR torchrun --nproc-per-node N plain_ddp.py MODE [ddp|fsdp]
(positional only: torchrun's own parser would take an abbreviated --option)
MODE: healthy (every rank at the same pace) or straggler (from the start, as after the
straggle event below: rank PLAIN_DDP_SLOW_RANK does SLOW_FACTOR times the compute of the
others each step, and each rank waits on its device DEVICE_FACTOR times its forward).

An event, at a step every rank reaches (so every rank takes it at the same step), given by
PLAIN_DDP_EVENT="KIND:STEP" or, once it exists, by the file PLAIN_DDP_TRIGGER holding it
(read at every step: a test may write one event after another):
  hang:S      rank PLAIN_DDP_HANG_RANK (1 by default) sleeps before its forward of step S
              (the others wait in backward, or in FSDP2's all_gather);
  mismatch:S  rank 0 enters all_reduce, the other ranks a broadcast from rank 0: they never
              meet (gloo keeps the two apart, and a receiving rank cannot finish alone;
              as the sender, a rank would return once its bytes are buffered, and move on);
  straggle:S  from step S on, a healthy job becomes a straggler job: rank
              PLAIN_DDP_SLOW_RANK does SLOW_FACTOR times the others' work, and each rank
              then waits on its device DEVICE_FACTOR times as long as its forward took
              (the straggler's device is as much slower as its host), not the fixed
              PLAIN_DDP_STEP_SLEEP.

Ground truth goes to DIR/rank<R>.jsonl (one JSON object a line): {"event": "ready",
"repeat", "pid"}, {"event": "step", "step", "seconds"}, {"event": "straggle", "repeat"} and
{"event": "hang"|"mismatch", "file", "line", "collective"}. Every rank is bounded
(lifeline.bound). PLAIN_DDP_STEP_SLEEP=S makes every rank sleep S seconds after each step
(a paced job).
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
SLOW_RANK = int(os.environ.get("PLAIN_DDP_SLOW_RANK", "1"))
HANG_RANK = int(os.environ.get("PLAIN_DDP_HANG_RANK", "1"))
# Seconds every rank sleeps after each step, as a job waiting on I/O or its device does:
# a test that does not depend on the job's load leaves the node's CPUs to the others
STEP_SLEEP = float(os.environ.get("PLAIN_DDP_STEP_SLEEP", "0"))
WORK = 6  # matmuls per forward
# The straggler's work: three times the others'. Steps this small are half gloo transfers, and
# on a loaded node those wait for a CPU on every rank: a 2x straggler's collective-wait share
# (0.31) was then more than half the others' (0.55), which docs/diagnosis.md does not name.
SLOW_FACTOR = 3
# A straggler job's device time a step, in forwards: every share of a step then holds on
# any node, idle or loaded (the others wait about two thirds of the straggler's step, the
# straggler almost never), with about half the CPU of its ranks computing flat out.
DEVICE_FACTOR = 3.0

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["healthy", "straggler"])
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


class Event:
    """The event to take and its step, from PLAIN_DDP_EVENT or the trigger file (its last
    content: tests replace it whole, by a rename)."""

    def __init__(self) -> None:
        self.trigger = os.environ.get("PLAIN_DDP_TRIGGER", "")
        self.spec = os.environ.get("PLAIN_DDP_EVENT", "")

    def at(self, step: int) -> str:
        if self.trigger:
            try:
                with open(self.trigger) as fh:
                    self.spec = fh.read().strip()
            except FileNotFoundError:
                pass
        kind, _, when = self.spec.partition(":")
        return kind if when.isdigit() and int(when) == step else ""


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

    def work(straggling: bool) -> int:
        return SLOW_FACTOR * WORK if straggling and rank == SLOW_RANK else WORK

    straggling = args.mode == "straggler"
    repeat = work(straggling)
    note(event="ready", repeat=repeat, pid=os.getpid())
    events = Event()
    step = 0
    while True:
        began = time.monotonic()
        x = torch.randn(64, 256)
        event = events.at(step)
        if event == "straggle":
            repeat, straggling = work(True), True
            note(event="straggle", repeat=repeat)
        if event == "hang" and rank == HANG_RANK:
            note(event="hang", file=os.path.basename(__file__), line=here() + 1)
            time.sleep(3600)  # the culprit: never reaches its forward, the others wait in backward
        if event == "mismatch":
            t = torch.ones(1)
            if rank == 0:
                note(event="mismatch", file=os.path.basename(__file__), line=here() + 1, collective="all_reduce")
                dist.all_reduce(t)
            else:
                note(event="mismatch", file=os.path.basename(__file__), line=here() + 1, collective="broadcast")
                dist.broadcast(t, src=0)
        forward_began = time.monotonic()
        loss = model(x, repeat)
        forward = time.monotonic() - forward_began
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        note(event="step", step=step, seconds=time.monotonic() - began)
        device = DEVICE_FACTOR * forward if straggling else STEP_SLEEP
        if device:
            time.sleep(device)


if __name__ == "__main__":
    main()

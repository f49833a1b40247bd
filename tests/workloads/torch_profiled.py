"""A tiny CPU training loop profiled with schedule(wait, warmup, active) and
tensorboard_trace_handler: real Kineto traces with ProfilerStep#N, DataLoader,
record_function ranges and [memory] events.

usage: torch_profiled.py OUT_DIR [--gzip] [--repeat N] [--delay S] [--linger S]
"""

import argparse
import time

import torch
from torch.profiler import (
    ProfilerActivity,
    profile,
    record_function,
    schedule,
    tensorboard_trace_handler,
)

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--gzip", action="store_true")
parser.add_argument("--repeat", type=int, default=1)
parser.add_argument("--delay", type=float, default=0.0)
parser.add_argument("--linger", type=float, default=0.0)
args = parser.parse_args()

time.sleep(args.delay)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.randn(512, 64), torch.randint(0, 10, (512,))), batch_size=32
)
with profile(
    activities=[ProfilerActivity.CPU],
    schedule=schedule(wait=1, warmup=1, active=3, repeat=args.repeat),
    on_trace_ready=tensorboard_trace_handler(args.out, use_gzip=args.gzip),
    profile_memory=True,
) as prof:
    for step, (x, y) in enumerate(data):
        if step >= 5 * args.repeat:
            break
        with record_function("forward"):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        with record_function("backward"):
            loss.backward()
        opt.step()
        opt.zero_grad()
        prof.step()
time.sleep(args.linger)

"""A small PyTorch (CPU) training job for the demo, the tests and the benchmarks.

    python examples/train.py [--steps N] [--workers 2] [--trace-dir DIR] [--ranks 2]

With ``--ranks R`` it acts like torchrun: a launcher process starts R rank processes
with RANK/LOCAL_RANK/WORLD_SIZE set and waits for them. With ``--trace-dir`` every rank
profiles itself periodically with torch.profiler and tensorboard_trace_handler, which
is how users usually produce traces for profagent's watched folder.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def launch(args: argparse.Namespace) -> int:
    """torchrun-like launcher: one child per rank, all stopped when we are."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", f"demo-{os.getpid()}")
    argv = [a for a in sys.argv[1:]]
    i = argv.index("--ranks")
    del argv[i : i + 2]
    procs = []
    for rank in range(args.ranks):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.ranks),
                   TORCHELASTIC_RUN_ID=run_id)
        procs.append(subprocess.Popen([sys.executable, __file__, *argv], env=env))
    try:
        return max(p.wait() for p in procs)
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        return 130


def train(args: argparse.Namespace) -> None:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    torch.set_num_threads(1)
    torch.manual_seed(int(os.environ.get("RANK", "0")))

    class Synthetic(Dataset):
        def __len__(self) -> int:
            return 1 << 30

        def __getitem__(self, i: int):
            if args.slow_data:
                time.sleep(args.slow_data)
            g = torch.Generator().manual_seed(i)
            x = torch.randn(64, generator=g)
            return x, (x.sum() > 0).long()

    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    loader = DataLoader(Synthetic(), batch_size=args.batch, num_workers=args.workers,
                        persistent_workers=args.workers > 0)

    profiler = None
    rank = os.environ.get("RANK", "0")
    # A process profiling itself holds libkineto, so on-demand traces of it wait; the demo
    # profiles one rank in-process and leaves the other free for `profagent trace`.
    if args.trace_dir and (not args.profile_ranks or rank in args.profile_ranks.split(",")):
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        profiler = profile(
            activities=[ProfilerActivity.CPU],
            schedule=schedule(wait=args.profile_every, warmup=1, active=3, repeat=0),
            on_trace_ready=tensorboard_trace_handler(args.trace_dir, worker_name=f"rank{rank}", use_gzip=True),
            profile_memory=True,
        )
        profiler.start()

    while args.start_after and not os.path.exists(args.start_after):
        time.sleep(0.1)
    step = 0
    for x, y in loader:
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.extra_work_file and os.path.exists(args.extra_work_file):
            # by the clock, not a count: the same added time on an idle or a loaded machine
            until = time.perf_counter() + args.extra_work_ms / 1000
            extra = torch.ones(128, 128)
            while time.perf_counter() < until:
                extra = extra @ extra / 128
        if step % 50 == 0:
            print(f"rank {os.environ.get('RANK', '0')} step {step} loss {loss.item():.3f}", flush=True)
        if profiler is not None:
            profiler.step()
        step += 1
        if args.steps and step >= args.steps:
            break
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if profiler is not None:
        profiler.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=0, help="stop after N steps (0 = run until killed)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--ranks", type=int, default=0, help="act as a launcher starting this many ranks")
    parser.add_argument("--trace-dir", default="", help="write torch profiler traces here")
    parser.add_argument("--profile-every", type=int, default=40, help="steps between profiled windows")
    parser.add_argument("--profile-ranks", default="", help="comma-separated ranks that profile themselves (default all)")
    parser.add_argument("--slow-data", type=float, default=0.0, help="seconds of sleep per sample")
    parser.add_argument("--step-sleep", type=float, default=0.01, help="seconds of sleep per step")
    parser.add_argument("--extra-work-file", default="",
                        help="while this file exists, each step spends --extra-work-ms more in matrix products (a change made on purpose)")
    parser.add_argument("--extra-work-ms", type=float, default=40.0)
    parser.add_argument("--start-after", default="",
                        help="wait until this file exists before the first step, torch loaded (a job waiting for its data)")
    args = parser.parse_args()
    if args.ranks:
        return launch(args)
    try:
        train(args)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

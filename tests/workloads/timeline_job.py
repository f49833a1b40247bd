"""A training loop as users write it, logging its own step and stage times, for the
timeline tests. Run alone (one process) or under torchrun (DDP over gloo, CPU).

usage: [torchrun --nproc-per-node N] timeline_job.py --truth-dir DIR --go-file FILE
       [--steps N] [--accum K] [--workers W] [--slow-loader-rank R] [--slow-rank R]
       [--slow-factor F] [--raise-in-backward] [--seconds S] [--fsdp2] [--device-seconds S]
       [--slow-layers] [--batch B] [--profile-dir D] [--linger S]
       [--slow-file FILE --slow-device-seconds S [--slow-steps K]] [--closure | --compile]

It waits for FILE before its first step, so an agent can place its probes first. Then it
writes DIR/rankR.json: the monotonic time of every optimizer.step() call (from a step
pre-hook) and, per step, the seconds it spent in next(loader), in loss.backward() (as the
autograd engine ran it, from a hook and a callback inside it) and in optimizer.step() plus
zero_grad(), measured around each call with time.monotonic(), and
the seconds its own layers' forwards took (inside FSDP2's hooks: no collective wait in
them).

--fsdp2 shards each layer and the model with ``fully_shard`` (FSDP2) instead of DDP.
--device-seconds sleeps that long each step where a GPU-bound job's host waits for its
device; once --slow-file exists, it sleeps --slow-device-seconds instead (a step-time
regression), and ends after --slow-steps such steps when given. --slow-rank makes that
rank's compute take --slow-factor times as long: its host compute (a busy loop), or with
--device-seconds its device alone (a slower GPU: no CPU spent on it). --slow-layers
instead makes each of its layers compute twice, forward and backward, so it arrives last
at nearly every collective.

--closure steps as Lightning does, ``optimizer.step(closure)``: the closure's forward,
zero_grad and backward run inside Optimizer.step's block; it logs the closure's own
times. --compile compiles the model and a function calling ``opt.step()``
(torch.compile), whose record_function dynamo drops, and zeroes the gradients with the
model's ``zero_grad()`` (as HF's Trainer does; ``Optimizer.zero_grad`` runs uncompiled
and would leave its block): it logs the start of each backward, the steps' only
boundary left, as its step calls. With --optimizer-zero-grad it calls
``opt.zero_grad()`` instead, whose block is then the boundary: it logs each call's time
as its step calls, and the call's length.
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
parser.add_argument("--steps", type=int, default=150)
parser.add_argument("--seconds", type=float, default=0.0, help="run this long instead of --steps")
parser.add_argument("--accum", type=int, default=1)
parser.add_argument("--workers", type=int, default=1)
parser.add_argument("--slow-loader-rank", type=int, default=-1)
parser.add_argument("--slow-rank", type=int, default=-1)
parser.add_argument("--slow-factor", type=float, default=1.5)
parser.add_argument("--raise-in-backward", action="store_true")
parser.add_argument("--save-at-step", type=int, default=-1, help="rank 0 saves a checkpoint for --save-seconds, then a barrier")
parser.add_argument("--save-seconds", type=float, default=40.0)
parser.add_argument("--hang-at-step", type=int, default=-1, help="rank 1 stops for good in its forward at this step")
parser.add_argument("--fsdp2", action="store_true")
parser.add_argument("--device-seconds", type=float, default=0.0)
parser.add_argument("--slow-file", default="", help="once this file exists, the device takes --slow-device-seconds a step")
parser.add_argument("--slow-device-seconds", type=float, default=0.0)
parser.add_argument("--slow-steps", type=int, default=0, help="one process only: end this many steps after --slow-file appears")
parser.add_argument("--slow-layers", action="store_true")
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--profile-dir", default="", help="also profile every step, a trace of --profile-steps written here each cycle")
parser.add_argument("--profile-steps", type=int, default=40)
parser.add_argument("--closure", action="store_true", help="optimizer.step(closure), as Lightning calls it")
parser.add_argument("--compile", action="store_true", help="torch.compile the model and opt.step(); the model's zero_grad()")
parser.add_argument("--optimizer-zero-grad", action="store_true", help="with --compile: opt.zero_grad(), not the model's")
parser.add_argument("--linger", type=float, default=0.0, help="seconds to stay after logging the truth (an agent attached to it exits with it)")
args = parser.parse_args()
RANK = int(os.environ.get("RANK", "0"))


class Images(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int):
        if args.slow_loader_rank == RANK:
            time.sleep(0.004)  # a slow decode on this rank's workers only
        return torch.randn(3, 16, 16), torch.randint(0, 10, ()).item()


class Failing(torch.autograd.Function):
    """A backward that raises, as a user's code may (caught by the loop)."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed on purpose")


class Layer(torch.nn.Module):
    """A layer that times its own forward; on a --slow-layers rank it computes twice (the
    second result times zero: the same values and gradients for twice the work)."""

    forward_seconds = 0.0

    def __init__(self, *modules: torch.nn.Module, twice: bool) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(*modules)
        self.twice = twice

    def forward(self, x):
        if args.compile:  # a clock read in a compiled forward breaks its graph: not timed
            return self.inner(x)
        t0 = time.monotonic()
        y = self.inner(x)
        if self.twice:
            y = y + 0.0 * self.inner(x)
        Layer.forward_seconds += time.monotonic() - t0
        return y


def model() -> torch.nn.Sequential:
    twice = args.slow_layers and args.slow_rank == RANK
    return torch.nn.Sequential(
        Layer(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), twice=twice),
        Layer(torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU(), twice=twice),
        torch.nn.Flatten(), Layer(torch.nn.Linear(32 * 16 * 16, 10), twice=twice))


def shard(net: torch.nn.Sequential) -> torch.nn.Module:
    """FSDP2 as its docs show: each layer, then the whole model."""
    from torch.distributed.fsdp import fully_shard
    for layer in net:
        if isinstance(layer, Layer):
            fully_shard(layer)
    return fully_shard(net)


def save_checkpoint(seconds: float) -> None:
    time.sleep(seconds)  # a slow filesystem: the other ranks wait at the barrier


def stuck_in_forward() -> None:
    while True:
        time.sleep(1)  # never returns: the other ranks wait in the next collective


def profiled(folder: str):
    """The torch profiler on every step (no wait), a trace each cycle, as a job that keeps
    profiling does; None without a folder."""
    if not folder:
        return None
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        schedule=torch.profiler.schedule(wait=0, warmup=1, active=args.profile_steps),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(folder))
    profiler.start()
    return profiler


def engine_clock(loss: "torch.Tensor") -> list[float]:
    """[start, end] of loss.backward() as the autograd engine runs it, filled in during the
    call: a hook on the first node and a callback after every other one (DDP's and FSDP2's
    own end-of-backward callbacks, queued while the graph runs, come before it). Times taken
    around the Python call would put its argument checks and a loaded node's preemptions
    between the job's clock and the probes on Engine::execute."""
    times: list[float] = []
    engine = torch.autograd.Variable._execution_engine

    def first_node(_grads: object) -> None:
        times.append(time.monotonic())
        # queued from a callback, so it runs after those the graph's own hooks queue
        engine.queue_callback(lambda: engine.queue_callback(lambda: times.append(time.monotonic())))

    loss.grad_fn.register_prehook(first_node)
    return times


def finished(step: int, until: float, distributed: bool) -> bool:
    """--steps, or --seconds: then every rank stops at the same step (the first rank past
    the time decides, through an all_reduce of the flags, as time-boxed jobs do)."""
    if not args.seconds:
        return step >= args.steps
    done = torch.tensor([1.0 if time.monotonic() >= until else 0.0])
    if distributed:
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
    return bool(done.item())


def main() -> None:
    bound(int(300 + args.seconds))  # five minutes for start-up and the end, besides the steps
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    torch.manual_seed(RANK)
    net = model()
    if distributed:
        net = shard(net) if args.fsdp2 else torch.nn.parallel.DistributedDataParallel(net)
    if args.compile:
        net = torch.compile(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    compiled_step = torch.compile(opt.step) if args.compile else opt.step
    loader = torch.utils.data.DataLoader(Images(), batch_size=args.batch, num_workers=args.workers)
    batches = iter(loader)
    start = Path(args.go_file)
    while not start.exists():
        time.sleep(0.05)
    if distributed:
        dist.barrier()  # every rank starts together
    calls: list[float] = []
    slow_compute = args.slow_rank == RANK and not args.slow_layers  # --slow-factor on this rank
    # Each step call's time from a step pre-hook: torch runs it first thing inside
    # Optimizer.step's record_function, microseconds after the probe there. A time taken
    # before the call would put the node's preemptions between the two clocks.
    if not args.compile:  # a compiled step would trace the hook; there, each backward's start
        opt.register_step_pre_hook(lambda *_: calls.append(time.monotonic()))
    stages: list[dict[str, float]] = []
    raised = 0
    until = time.monotonic() + args.seconds
    step = 0
    profiler = profiled(args.profile_dir)
    slow_steps = 0
    if distributed and args.slow_steps:
        parser.error("--slow-steps is for one process: ranks would see the slow file at different steps")
    while not finished(step, until, distributed) and not (args.slow_steps and slow_steps >= args.slow_steps):
        step += 1
        if step == args.save_at_step and distributed:
            marker = Path(args.truth_dir, "saving")
            marker.write_text(str(time.monotonic()))
            if RANK == 0:
                save_checkpoint(args.save_seconds)
            dist.barrier()
            Path(args.truth_dir, f"saved{RANK}").write_text(str(time.monotonic()))
        if step == args.hang_at_step and RANK == 1:
            Path(args.truth_dir, "hanging").write_text(str(time.monotonic()))
            stuck_in_forward()
        data = backward = 0.0
        closure_times: dict[str, float] = {}
        for _ in range(args.accum):
            t0 = time.monotonic()
            x, y = next(batches)
            t1 = time.monotonic()
            data += t1 - t0
            if args.closure:
                break  # the closure's forward and backward run inside the step below
            loss = torch.nn.functional.cross_entropy(net(x), y) / args.accum
            inside = engine_clock(loss)
            loss.backward()
            t2, t3 = inside
            if args.compile and not args.optimizer_zero_grad:
                calls.append(t2)
            if slow_compute and not args.device_seconds:
                # a straggler: its compute takes slow_factor times as long
                extra = time.monotonic() + (args.slow_factor - 1.0) * (t3 - t1)
                while time.monotonic() < extra:
                    pass
            backward += t3 - t2
        if args.raise_in_backward:
            try:
                Failing.apply(torch.ones(1, requires_grad=True)).sum().backward()
            except RuntimeError:
                raised += 1
        device = args.device_seconds
        if slow_compute:
            device *= args.slow_factor  # with a device, the straggler's device is the slow part
        if args.slow_file and os.path.exists(args.slow_file):  # a regression: the device got slower
            device = args.slow_device_seconds
            slow_steps += 1
        if device:
            time.sleep(device)  # the device computes; the host waits for it
        t4 = time.monotonic()
        if args.closure:
            def closure(x=x, y=y, times=closure_times) -> torch.Tensor:
                begin = time.monotonic()
                loss = torch.nn.functional.cross_entropy(net(x), y)
                zero = time.monotonic()
                opt.zero_grad()
                times["zero_grad"] = time.monotonic() - zero
                inside = engine_clock(loss)
                loss.backward()
                times["backward"] = inside[1] - inside[0]
                times["closure"] = time.monotonic() - begin
                return loss

            opt.step(closure)
        elif args.compile:
            compiled_step()
            if args.optimizer_zero_grad:
                calls.append(time.monotonic())
                opt.zero_grad()
                closure_times["zero_grad"] = time.monotonic() - calls[-1]
            else:
                net.zero_grad()
        else:
            opt.step()
            opt.zero_grad()
        if profiler is not None:
            profiler.step()
        if args.closure:  # the step's call less its closure, and the closure's zero_grad
            backward = closure_times["backward"]
            optimizer = time.monotonic() - t4 - closure_times["closure"] + closure_times["zero_grad"]
        else:
            optimizer = time.monotonic() - t4
        stages.append({"data_wait": data, "backward": backward, "optimizer": optimizer,
                       "forward_compute": Layer.forward_seconds, "zero_grad": closure_times.get("zero_grad", 0.0)})
        Layer.forward_seconds = 0.0
    Path(args.truth_dir, f"rank{RANK}.json").write_text(json.dumps(
        {"calls": calls, "stages": stages, "raised": raised, "pid": os.getpid()}))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    time.sleep(args.linger)


if __name__ == "__main__":
    main()

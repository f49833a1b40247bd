"""The ground truth and the modes the framework jobs share (hf_trainer_job.py,
lightning_job.py, accelerate_job.py, compile_job.py): each rank logs its own optimizer
step calls and stage blocks to FW_LOG/rank<R>.jsonl, one JSON object a line, and takes
the events a test writes to FW_TRIGGER ("KIND:STEP", read at each step, as plain_ddp.py).

Lines: {"event": "ready"}; {"event": "step", "step", "time", "call"} at each
Optimizer.step call (monotonic "call" from a step pre-hook, inside torch's block);
{"event": "block", "stage", "start", "end"} for each DataLoader wait, backward (as the
autograd engine ran it) and optimizer block (less what the framework ran inside it: a
closure's forward and backward); {"event": "straggle"|"pause"|"resumed"|"hang", ...}.
Events: straggle (from then on rank FW_SLOW_RANK's device takes FW_SLOW_FACTOR times as
long), pause (every rank saves for FW_PAUSE_SECONDS), hang (rank FW_HANG_RANK stops for
good). Each forward waits FW_DEVICE_SECONDS on its "device" (a sleep: the suite is bound
by its 2 cores), FW_GO is waited for before the first step.
"""

from __future__ import annotations

import inspect
import json
import os
import time
from collections.abc import Callable

import torch

SLOW_RANK = int(os.environ.get("FW_SLOW_RANK", "1"))
HANG_RANK = int(os.environ.get("FW_HANG_RANK", "1"))
SLOW_FACTOR = float(os.environ.get("FW_SLOW_FACTOR", "1.5"))
DEVICE_SECONDS = float(os.environ.get("FW_DEVICE_SECONDS", "0.04"))
PAUSE_SECONDS = float(os.environ.get("FW_PAUSE_SECONDS", "60"))
MAX_SECONDS = int(os.environ.get("FW_MAX_SECONDS", "900"))


class Points(torch.utils.data.Dataset):
    """The jobs' synthetic data: a vector and a label per index, the same on every run."""

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return torch.randn(128, generator=g), torch.randint(0, 10, (), generator=g)


def rank() -> int:
    """This process's rank: torchrun's RANK, else Lightning's children's LOCAL_RANK."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


class Truth:
    """One rank's log and its events."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        folder = os.environ.get("FW_LOG", ".")
        self._log = open(os.path.join(folder, f"rank{rank}.jsonl"), "a", buffering=1)  # noqa: SIM115
        self._trigger = os.environ.get("FW_TRIGGER", "")
        self._spec = ""
        self.steps = 0  # Optimizer.step calls
        self.straggling = False
        self._forward_began = 0.0

    def note(self, **event: object) -> None:
        self._log.write(json.dumps({"rank": self.rank, **event}) + "\n")

    def block(self, stage: str, start: float, end: float) -> None:
        if end > start:
            self.note(event="block", stage=stage, start=start, end=end)

    def wait_for_go(self) -> None:
        self.note(event="ready", pid=os.getpid())
        go = os.environ.get("FW_GO", "")
        while go and not os.path.exists(go):
            time.sleep(0.05)

    def watch_optimizer(self, opt: torch.optim.Optimizer, nested: Callable[[], float] | None = None) -> None:
        """Log each step call (a pre-hook: torch runs it first thing inside Optimizer.step's
        block) and the block as an optimizer block, less ``nested()`` seconds (what the
        framework ran inside it, measured by the job)."""
        began = [0.0]

        def pre(*_: object) -> None:
            began[0] = now = time.monotonic()
            self.steps += 1
            self.note(event="step", step=self.steps, time=time.time(), call=now)

        def post(*_: object) -> None:
            inside = nested() if nested is not None else 0.0
            self.note(event="block", stage="optimizer", start=began[0] + inside, end=time.monotonic())

        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)

    def backward_clock(self, loss: torch.Tensor) -> None:
        """Log loss.backward() as the autograd engine runs it: from a hook on its first node
        to a callback queued after every other one (DDP's end-of-backward callback comes
        before it): times taken around the Python call would hold its argument checks."""
        engine = torch.autograd.Variable._execution_engine
        began = [0.0]

        def ended() -> None:
            self.block("backward", began[0], time.monotonic())

        def first_node(_grads: object) -> None:
            began[0] = time.monotonic()
            engine.queue_callback(lambda: engine.queue_callback(ended))

        if loss.grad_fn is not None:
            loss.grad_fn.register_prehook(first_node)

    def device(self, began: float) -> None:
        """The forward's device time: a sleep, the host waiting as it would for a GPU.
        The straggler's device takes SLOW_FACTOR times as long, and its host's share of
        the forward (since ``began``) as much again."""
        seconds = DEVICE_SECONDS
        if self.straggling and self.rank == SLOW_RANK:
            seconds = SLOW_FACTOR * DEVICE_SECONDS + (SLOW_FACTOR - 1.0) * (time.monotonic() - began)
        time.sleep(seconds)

    def event(self) -> str:
        """The event for the next step (straggle is taken here: it sets a state)."""
        if self._trigger:
            try:
                with open(self._trigger) as fh:
                    self._spec = fh.read().strip()
            except FileNotFoundError:
                pass
        kind, _, when = self._spec.partition(":")
        if not (when.isdigit() and int(when) == self.steps + 1):
            return ""
        if kind == "straggle" and not self.straggling:
            self.straggling = True
            self.note(event="straggle", step=self.steps + 1, slow_rank=SLOW_RANK, factor=SLOW_FACTOR)
            return ""
        return kind

    def take(self, save: Callable[[float], None], stuck: Callable[[], None]) -> None:
        """Take this step's pause or hang in the job's own functions (the user's lines)."""
        kind = self.event()
        if kind == "pause":
            self._spec = ""  # once
            self.note(event="pause", step=self.steps + 1, time=time.time(), **where(save))
            save(PAUSE_SECONDS)
            self.note(event="resumed", time=time.time())
        elif kind == "hang" and self.rank == HANG_RANK:
            self.note(event="hang", step=self.steps + 1, time=time.time(), monotonic=time.monotonic(), **where(stuck))
            stuck()


def where(fn: Callable[..., object]) -> dict[str, object]:
    """The file, function and line of ``fn``'s sleep: where its rank stands while in it."""
    lines, first = inspect.getsourcelines(fn)
    line = first + next(i for i, text in enumerate(lines) if "time.sleep" in text)
    return {"file": os.path.basename(inspect.getsourcefile(fn) or ""), "function": fn.__name__, "line": line}


def time_data_waits(truth: Truth) -> None:
    """Log each DataLoader wait: its iterators' ``__next__``, around the call that holds
    torch's own ``enumerate(DataLoader)`` block (whichever framework asks for the batch)."""
    from torch.utils.data import dataloader

    original = dataloader._BaseDataLoaderIter.__next__

    def timed(self: object) -> object:
        t0 = time.monotonic()
        try:
            return original(self)
        finally:
            truth.block("data_wait", t0, time.monotonic())

    dataloader._BaseDataLoaderIter.__next__ = timed  # type: ignore[method-assign]


class Tokens(torch.utils.data.Dataset):
    """Synthetic token sequences (no download): the same on every call, per index."""

    def __init__(self, vocab: int, length: int, size: int = 1 << 20) -> None:
        self.vocab, self.length, self.size = vocab, length, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, self.vocab, (self.length,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}

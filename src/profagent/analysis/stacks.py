"""What a Python stack sample says the job is doing. Pure: no I/O, no clock.

Parses py-spy's folded output into ``Sample``s and puts each stack in one category
(``classify``, docs/stacks.md), which the stacks source counts and the findings read.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass

from profagent.contracts import Frame
from profagent.labels import OTHER

CATEGORIES = (
    "dataloader", "host_sync", "optimizer", "backward", "forward",
    "collective", "checkpoint_io", "compile", "idle", "other",
)



@dataclass(frozen=True)
class Sample:
    """``count`` identical samples of one thread's stack (frames root first)."""

    thread: str  # the thread name py-spy reports ("MainThread", "pin_memory"...)
    main: bool  # the process' main thread (OS thread id == PID, or named MainThread)
    frames: tuple[Frame, ...]
    count: int
    folded: str  # the line as py-spy wrote it, without the count

    @property
    def leaf(self) -> Frame | None:
        return self.frames[-1] if self.frames else None


_FRAME = re.compile(r"^(?P<name>.*) \((?P<file>[^()]*?):(?P<line>\d+)\)$")
_THREAD = re.compile(r"^thread \((?P<tid>[^)]*)\)(?:: (?P<name>.*))?$")


def parse_frame(text: str) -> Frame:
    m = _FRAME.match(text)
    if m is None:  # a frame without a location (e.g. a process or native frame)
        return Frame(text, "", 0)
    return Frame(m.group("name"), m.group("file"), int(m.group("line")))


# What one window of py-spy output may cost, whatever the job's names and recursion (a rank
# recursing 600 deep through 4,000-character names and files once took the agent to 1.6 GB):
MAX_FRAME_CHARS = 300  # of a frame's function name, and of its file (its end is kept: the folders classify)
MAX_DEPTH = 200  # frames kept per stack, the innermost (the leaf classifies); the rest become one "… N frames"
MAX_STACKS = 2000  # distinct stacks kept per window; the rest are dropped and counted
MAX_WINDOW_CHARS = 4 << 20  # characters of stacks kept per window (the folded lines, once cut)
LONGEST_PART = 2 * MAX_FRAME_CHARS + 24  # a frame "name (file:line)" of two parts within the cap, or a thread part


@dataclass(frozen=True)
class Folded:
    """One window's samples, and how many distinct stacks (samples) were dropped by the caps."""

    samples: list[Sample]
    dropped_stacks: int = 0
    dropped_samples: int = 0


# Input is py-spy's folded (``raw``) output recorded with ``--threads --idle``: one line per
# distinct stack, root first, then a count::
#
#     thread (4242): MainThread;<module> (train.py:9);Module._call_impl (torch/nn/modules/module.py:1789) 12
def parse_folded(text: str, pid: int) -> list[Sample]:
    """Parse py-spy raw output of process ``pid``. Malformed lines are skipped; the caps of
    :func:`fold_capped` hold."""
    return fold_capped(text, pid).samples


def fold_capped(text: str | Iterable[str], pid: int) -> Folded:
    """py-spy raw output of process ``pid`` (its text, or its lines), each frame cut at
    MAX_FRAME_CHARS, each stack at MAX_DEPTH frames, at most MAX_STACKS stacks and
    MAX_WINDOW_CHARS characters in all."""
    samples: list[Sample] = []
    kept_chars = dropped = dropped_samples = 0
    for line in text.splitlines() if isinstance(text, str) else text:
        stack, sep, count = line.rstrip().rpartition(" ")
        if not sep or not count.isdigit() or not stack:
            continue
        if len(samples) >= MAX_STACKS or kept_chars >= MAX_WINDOW_CHARS:
            dropped += 1
            dropped_samples += int(count)
            continue
        parts = stack.split(";")
        head: list[str] = []  # the thread part, as py-spy wrote it
        thread, main = "", False
        m = _THREAD.match(parts[0]) if len(parts[0]) <= LONGEST_PART else None
        if m is not None:
            head = [parts[0]]
            parts = parts[1:]
            thread = m.group("name") or ""
            tid = m.group("tid")
            main = thread == "MainThread" or (tid.isdigit() and int(tid) == pid)
        if len(parts) <= MAX_DEPTH and all(len(p) <= LONGEST_PART for p in parts):
            frames = tuple(parse_frame(p) for p in parts)
        else:  # cut: the folded line is written again from what is kept
            skipped = max(0, len(parts) - MAX_DEPTH)
            frames = tuple(_cut_frame(parse_frame(p)) for p in parts[skipped:])
            if skipped:
                frames = (Frame(f"… {skipped} frames", "", 0), *frames)
            stack = ";".join([*head, *(str(f) for f in frames)])
        kept_chars += len(stack)
        samples.append(Sample(thread, main, frames, int(count), stack))
    return Folded(samples, dropped, dropped_samples)


def _cut_frame(frame: Frame) -> Frame:
    """``frame`` with its name's start and its file's end kept, MAX_FRAME_CHARS of each."""
    name, file = frame.name, frame.file
    if len(name) <= MAX_FRAME_CHARS and len(file) <= MAX_FRAME_CHARS:
        return frame
    if len(name) > MAX_FRAME_CHARS:
        name = name[:MAX_FRAME_CHARS] + "…"
    if len(file) > MAX_FRAME_CHARS:
        file = "…" + file[-MAX_FRAME_CHARS:]
    return Frame(name, file, frame.line)


# -- classification ---------------------------------------------------------------------

_COMPILE_DIRS = ("torch/_dynamo/", "torch/_inductor/", "torch/_functorch/_aot_autograd/",
                 "torch/_functorch/aot_autograd.py", "torch/_functorch/partitioners.py")
# Files of those folders that also run on every call of an already compiled model, or of
# code that is never compiled: ``torch._dynamo.disable`` (decorators.py, eval_frame.py's
# DisableContext), which FSDP2 wraps around each of its hooks on every call.
_COMPILE_RUNTIME = ("eval_frame.py", "external_utils.py", "output_code.py", "runtime_wrappers.py",
                    "torch/_inductor/runtime/", "utils.py", "torch/_dynamo/decorators.py")
_CHECKPOINT = ("torch/serialization.py", "torch/distributed/checkpoint/", "safetensors/",
               "torch/_weights_only_unpickler.py")
_SYNC_DIRS = ("torch/cuda/", "torch/cpu/", "torch/xpu/", "torch/mps/", "torch/accelerator/")
_IDLE_LEAF = {
    "threading.py": ("wait", "acquire", "join", "_wait_for_tstate_lock"),
    "queue.py": ("get", "put"),
    "selectors.py": ("select",),
    "multiprocessing/connection.py": ("wait", "poll", "_poll", "recv", "_recv", "recv_bytes",
                                      "_recv_bytes", "accept"),
    "socket.py": ("accept", "recv_into", "readinto"),
    "subprocess.py": ("wait", "_wait", "_try_wait", "communicate"),
    "asyncio/base_events.py": ("_run_once", "select"),
}


def _in(file: str, prefixes: Iterable[str]) -> bool:
    return any(p in file for p in prefixes)


def _method(name: str) -> str:
    """``Event.synchronize`` -> ``synchronize``; ``f.<locals>.g`` -> ``g``."""
    return name.rsplit(".", 1)[-1]


def _is_compile(f: Frame) -> bool:
    return _in(f.file, _COMPILE_DIRS) and not _in(f.file, _COMPILE_RUNTIME)


def _innermost(f: Frame) -> str | None:
    """The tier-2 category of one frame, or None."""
    file, method = f.file, _method(f.name)
    if file.startswith("torch/") or "/torch/" in file:
        if method == "synchronize" and _in(file, _SYNC_DIRS):
            return "host_sync"
        if _in(file, ("torch/_tensor_str.py",)):
            return "host_sync"  # printing a tensor copies it to the host
        if "torch/distributed/" in file:
            return "collective"
        if "torch/utils/data/" in file:
            return "dataloader"
        if "torch/optim/" in file:
            return "optimizer"
        if "torch/autograd/" in file and (method in ("backward", "grad", "_engine_run_backward")
                                          or file.endswith("autograd/graph.py")):
            return "backward"
        if file.endswith("torch/_tensor.py") and method == "backward":
            return "backward"
        if "torch/nn/" in file and "torch/nn/parallel/" not in file:
            return "forward"
    if "multiprocessing/queues.py" in file:
        return "dataloader"
    return None


def _idle_leaf(f: Frame) -> bool:
    for suffix, methods in _IDLE_LEAF.items():
        if f.file.endswith(suffix) and _method(f.name) in methods:
            return True
    return False


# Categories (``classify``), decided in three tiers; see docs/stacks.md:
#
# 1. anywhere in the stack: ``compile`` (torch._dynamo / _inductor compiling), then
#    ``checkpoint_io`` (torch.save/load, torch.distributed.checkpoint, safetensors);
# 2. innermost match, walking from the leaf to the root: ``host_sync``, ``collective``,
#    ``dataloader``, ``optimizer``, ``backward``, ``forward``;
# 3. the leaf alone: ``idle`` (a thread waiting on a lock, queue, select or socket);
# 4. else ``other``.
#
# ``classify_with_idle`` adds one rule after these: a stack they leave as ``other`` whose
# leaf line `py-spy dump` saw idle (``idle_places``) is ``idle``. py-spy reads Python frames
# only, so ``time.sleep(...)`` in a training loop is sampled as the loop's own line.
def classify(frames: tuple[Frame, ...]) -> str:
    """The category of one stack (frames root first), by the tiers in the comment above."""
    if any(_is_compile(f) for f in frames):
        return "compile"
    if any(_in(f.file, _CHECKPOINT) for f in frames):
        return "checkpoint_io"
    for f in reversed(frames):
        category = _innermost(f)
        if category is not None:
            return category
    if frames and _idle_leaf(frames[-1]):
        return "idle"
    return OTHER


# -- the user's own frames, and where a stack stands still ---------------------------------

# Top-level packages that are not the user's code: the standard library and the frameworks a
# training job runs on. py-spy names files relative to sys.path ("selectors.py",
# "torch/nn/modules/module.py", "transformers/trainer.py", "accelerate/accelerator.py"),
# the same way as the user's own ("train.py"), so the package decides; a path py-spy left
# whole is a library's under site-packages/, dist-packages/ or a Python's lib/pythonX.Y/.
LIBRARY_PACKAGES = frozenset(sys.stdlib_module_names) | frozenset({
    "torch", "torchvision", "torchaudio", "torchtext", "torchdata", "functorch", "triton", "numpy",
    "PIL", "transformers", "accelerate", "lightning", "pytorch_lightning", "lightning_fabric",
    "lightning_utilities", "torchmetrics", "deepspeed", "apex", "fairscale", "timm", "datasets", "tqdm",
    "peft", "trl", "optimum", "huggingface_hub", "safetensors", "tokenizers", "evaluate", "bitsandbytes",
    "xformers", "flash_attn", "megatron", "colossalai", "composer", "torch_xla", "torchrec", "torchtune",
    "torchao", "einops", "ray", "hydra", "omegaconf", "wandb", "mlflow", "tensorboard", "tensorboardX",
    "scipy", "pandas", "sklearn", "filelock", "fsspec", "packaging", "typing_extensions",
    "site-packages", "dist-packages",
})
_LIBRARY_DIRS = re.compile(r"(^|/)(site-packages|dist-packages)/|/lib/python\d[\d.]*/")
_NATIVE_SOURCES = (".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".rs", ".S")
# Where a thread waits, from the user's line inward: everything deeper is the machinery of
# one wait (a poll loop that wakes every few seconds, a retry), not a change of place.
_WAIT_MACHINERY = ("threading.py", "queue.py", "selectors.py", "multiprocessing/", "socket.py",
                   "subprocess.py", "asyncio/", "concurrent/", "torch/utils/data/")


def is_native(f: Frame) -> bool:
    """A C/C++ frame of py-spy --native: no file ("symbol (library)"), or a C source file
    ("select_poll_poll_impl (selectmodule.c:655)" where the interpreter has debug symbols)."""
    return not f.file or f.file.endswith(_NATIVE_SOURCES)


def is_user(f: Frame) -> bool:
    """A Python frame of the job's own code: not native, not frozen, not a library's."""
    if is_native(f) or f.file.startswith("<"):
        return False
    top = f.file.lstrip("./").split("/", 1)[0]
    return top.removesuffix(".py") not in LIBRARY_PACKAGES and _LIBRARY_DIRS.search(f.file) is None


def own_frame(frames: Iterable[Frame]) -> Frame | None:
    """The innermost frame of the job's own code (``train (train.py:190)``), or None."""
    found = None
    for f in frames:
        if is_user(f):
            found = f
    return found


def innermost_python(frames: Iterable[Frame]) -> Frame | None:
    """The innermost Python (not native) frame."""
    found = None
    for f in frames:
        if not is_native(f):
            found = f
    return found


def standing_key(frames: Iterable[Frame]) -> str:
    """What must stay the same for a stack to stand still: its Python frames, cut after the
    first frame of wait machinery below the user's innermost line (a DataLoader's poll loop
    that wakes every 5 s, a select). Native frames are left out. Lines are kept: a loop of
    torch calls in one function shows only that function's lines, and it moves from line to line."""
    py = [f for f in frames if not is_native(f)]
    if not py:
        return ""
    user = max((i for i, f in enumerate(py) if is_user(f)), default=-1)
    cut = next((i for i in range(user + 1, len(py)) if _in(py[i].file, _WAIT_MACHINERY)), None)
    if cut is not None:
        py = py[: cut + 1]
    return ";".join(str(f) for f in py)


def waits_on_dataloader(frames: Iterable[Frame]) -> bool:
    """The main thread waits for its DataLoader's next batch (from its worker processes)."""
    return any(f.file.endswith("torch/utils/data/dataloader.py") and _method(f.name) in ("_get_data", "_try_get_data")
               for f in frames)


def fetching(frames: Iterable[Frame]) -> bool:
    """A DataLoader worker makes a batch (it runs the dataset), rather than waits for indices."""
    return any("torch/utils/data/_utils/fetch.py" in f.file for f in frames)


# -- waits in C that py-spy does not name (from `py-spy dump --json`) ----------------------

Place = tuple[str, str, int]  # (function, file, line) of a leaf frame, as py-spy names them
IDLE_PLACES_MAX = 64  # per process group: leaf lines seen idle, the newest kept


def idle_places(dump: object) -> frozenset[Place]:
    """The leaf lines at which `py-spy dump --json` saw a thread idle (not running).

    A thread asleep in a C call (``time.sleep``, a blocking read in an extension) shows
    its innermost Python frame, the line that made the call, and ``active: false``.
    ``dump`` is py-spy's parsed JSON: threads with ``active`` and ``frames``, innermost first.
    """
    places = set()
    for t in dump if isinstance(dump, list) else ():
        if not isinstance(t, dict) or t.get("active", True) or not isinstance(t.get("frames"), list) or not t["frames"]:
            continue
        leaf = t["frames"][0]
        if not isinstance(leaf, dict):
            continue
        name, file, line = leaf.get("name"), leaf.get("short_filename") or leaf.get("filename"), leaf.get("line")
        if isinstance(name, str) and isinstance(file, str) and isinstance(line, int) and not isinstance(line, bool):
            cut = _cut_frame(Frame(name, file, line))  # as the windows' leaves are cut
            places.add((cut.name, cut.file, line))
    return frozenset(places)


def remember_idle_places(known: dict[Place, None], seen: Iterable[Place]) -> None:
    """Add ``seen`` to ``known`` (insertion-ordered), keeping the newest IDLE_PLACES_MAX."""
    for place in seen:
        known.pop(place, None)
        known[place] = None
    for place in list(known)[: max(0, len(known) - IDLE_PLACES_MAX)]:
        del known[place]


def classify_with_idle(frames: tuple[Frame, ...], idle_at: Container[Place]) -> str:
    """``classify``, then: a stack it leaves as ``other`` whose leaf is a line a dump saw
    idle is ``idle``. Named categories (a DataLoader wait, a collective) stay as they are."""
    category = classify(frames)
    if category == OTHER and frames:
        leaf = frames[-1]
        if (leaf.name, leaf.file, leaf.line) in idle_at:
            return "idle"
    return category


# -- thread states (from `py-spy dump --json`) --------------------------------------------

def main_thread_sample(dump: object, pid: int) -> Sample | None:
    """The main thread's stack in py-spy's ``dump --json`` as one sample (frames root first),
    or None when the dump has no main thread with frames."""
    for t in dump if isinstance(dump, list) else ():
        if not isinstance(t, dict) or not (t.get("os_thread_id") == pid or t.get("thread_name") == "MainThread"):
            continue
        listed = t.get("frames") or []
        listed = listed[:MAX_DEPTH] if isinstance(listed, list) else []  # innermost first: the leaf side kept
        frames = tuple(
            _cut_frame(Frame(str(f.get("name", "")), str(f.get("short_filename") or f.get("filename") or ""),
                             _line(f.get("line"))))
            for f in reversed(listed) if isinstance(f, dict)
        )
        if frames:
            return Sample(str(t.get("thread_name") or ""), True, frames, 1, ";".join(map(str, frames)))
    return None


def _line(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def thread_states(dump: object) -> dict[tuple[str, str], int]:
    """Count threads by (state, gil): state active|idle, gil held|not_held.
    ``dump`` is py-spy's parsed JSON: a list of threads with ``active`` and ``owns_gil``."""
    counts: dict[tuple[str, str], int] = {}
    for t in dump if isinstance(dump, list) else ():
        if not isinstance(t, dict):
            continue
        key = ("active" if t.get("active") else "idle", "held" if t.get("owns_gil") else "not_held")
        counts[key] = counts.get(key, 0) + 1
    return counts


# -- top-K functions ------------------------------------------------------------------------

class TopK:
    """Monotonic counters for the K busiest leaf functions, the rest folded into ``other``.

    Membership follows an exponentially decayed count (half-life ``half_life`` seconds of
    sampled time), so a function that was hot an hour ago makes room for today's. Each
    sample is counted once, at the time it is seen: under its function if that function is
    a member then, else under ``other``. So every exported series only grows: a function
    that enters starts a new series, one that leaves stops being exported (its count is
    kept, so it resumes where it was if it comes back), and ``other`` never gives counts back.
    """

    def __init__(self, k: int, half_life: float = 300.0, max_tracked: int = 512) -> None:
        self.k = k
        self.half_life = half_life
        self.max_tracked = max(max_tracked, 4 * k)
        self._score: dict[str, float] = {}
        self._count: dict[str, int] = {}  # every function ever a member (bounded)
        self._members: set[str] = set()
        self.other = 0

    def add(self, counts: Mapping[str, int], elapsed: float) -> None:
        """Account one window: ``counts`` per function, ``elapsed`` seconds long."""
        decay = math.pow(0.5, max(elapsed, 0.0) / self.half_life)
        for fn in self._score:
            self._score[fn] *= decay
        for fn, n in counts.items():
            self._score[fn] = self._score.get(fn, 0.0) + n
        ranked = sorted(self._score, key=lambda fn: (-self._score[fn], fn))
        if len(ranked) > self.max_tracked:
            for fn in ranked[self.max_tracked:]:
                del self._score[fn]
        self._members = set(ranked[: self.k])
        for fn, n in counts.items():
            if fn in self._members:
                self._count[fn] = self._count.get(fn, 0) + n
            else:
                self.other += n
        if len(self._count) > self.max_tracked:  # forget the least useful ex-members
            for fn in sorted(self._count, key=lambda f: self._score.get(f, 0.0))[: len(self._count) - self.max_tracked]:
                if fn not in self._members:
                    del self._count[fn]

    def series(self) -> list[tuple[str, int]]:
        """(function, total) for the current members, plus ("other", total)."""
        rows = sorted(((fn, self._count.get(fn, 0)) for fn in self._members), key=lambda r: (-r[1], r[0]))
        return [*rows, (OTHER, self.other)]


# -- stall detection --------------------------------------------------------------------------

@dataclass(frozen=True)
class StallStatus:
    stalled: bool
    unchanged_seconds: float
    frames: tuple[Frame, ...]
    started: bool  # True only on the update where the stall began (log it then, once)


class StallTracker:
    """Tracks how long one rank's main-thread stack has stayed identical.

    Windows are the unit: a window whose main-thread samples all share one stack extends
    the run if it is the same stack as before, else starts a new run at the window start.
    A window with several stacks (or none) ends the run. Stacks are compared by
    ``standing_key``: one wait whose innermost frames change (a poll loop) stands still. The
    rank is stalled when the run is longer than ``stall_seconds`` and ``busy`` is not True:
    True when another signal says it works (its GPUs are busy, or its kernel probes saw it
    step lately: a rank that waits for a straggler in every step may show that one wait in
    every sample of a window), False when its GPUs are idle, None when nothing is known.
    """

    def __init__(self, stall_seconds: float) -> None:
        self.stall_seconds = stall_seconds
        self._stack: str | None = None
        self._frames: tuple[Frame, ...] = ()
        self._since: float | None = None
        self._stalled = False

    @property
    def since(self) -> float | None:
        """When the current run of one unchanged stack began (its first window's start)."""
        return self._since

    def update(self, main_samples: list[Sample], start: float, end: float, busy: bool | None) -> StallStatus:
        stacks = {standing_key(s.frames) for s in main_samples}
        if len(stacks) != 1:
            self._stack, self._since, self._frames = None, None, ()
        else:
            stack = stacks.pop()
            if stack != self._stack or self._since is None:
                self._stack, self._since, self._frames = stack, start, main_samples[0].frames
        unchanged = end - self._since if self._since is not None else 0.0
        stalled = unchanged > self.stall_seconds and busy is not True
        started = stalled and not self._stalled
        self._stalled = stalled
        return StallStatus(stalled, unchanged, self._frames, started)


# a py-spy text dump's frame line: '    train_step (train.py:42)'
_DUMP_FRAME = re.compile(r"^\s+(\S.*?) \((\S+\.py):(\d+)\)\s*$")
# py-spy's thread line: 'Thread 4242 (idle): "MainThread"', 'Thread 0x7F.. (active+gil): "x"'.
_DUMP_THREAD = re.compile(r'^Thread \S+ \(([^)]*)\): "(.*)"\s*$')


def innermost_frame(dump: str) -> str | None:
    """``function (file.py:line)`` of the main thread's innermost Python frame in a py-spy
    text dump (the first thread when none is named MainThread)."""
    blocks: list[tuple[str, list[str]]] = []
    for line in dump.splitlines():
        m = _DUMP_THREAD.match(line)
        if m:
            blocks.append((m.group(2), []))
        elif blocks:
            f = _DUMP_FRAME.match(line)
            if f:
                blocks[-1][1].append(f"{f.group(1)} ({f.group(2)}:{f.group(3)})")
    main = next((frames for name, frames in blocks if name == "MainThread"), blocks[0][1] if blocks else [])
    return main[0] if main else None


def dominant_stack(main: list[Sample]) -> tuple[Frame, ...]:
    """The main thread's most sampled stack of one window (root first); () without samples."""
    counts: dict[str, int] = {}
    frames: dict[str, tuple[Frame, ...]] = {}
    for s in main:
        counts[s.folded] = counts.get(s.folded, 0) + s.count
        frames[s.folded] = s.frames
    return frames[max(counts, key=lambda k: (counts[k], k))] if counts else ()

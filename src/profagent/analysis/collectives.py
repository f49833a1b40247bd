"""Where a rank waits in a collective: the frame patterns, in one place. Pure: no I/O.

A rank's main thread is in the collective layer when its Python stack is in
``torch.distributed`` (an explicit ``all_reduce``, FSDP2's hooks, ``barrier``...) or when
its native frames (``py-spy --native``) are. In plain DDP no collective appears in the
Python stack: the C++ reducer issues the all_reduce inside ``backward()`` and waits for it
in ``c10d::Reducer::finalize_backward``, under ``_engine_run_backward``. Only native frames
tell that wait from backward's own compute.

Each pattern here has a unit test on real ``py-spy dump --native`` output
(tests/unit/fixtures/native, tests/unit/test_collectives.py). Native frames are Frames
with no file (``name`` is py-spy's ``symbol (library)``); Python frames have a file.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from profagent.analysis.stacks import Sample, is_native, is_user, parse_frame, standing_key
from profagent.contracts import Frame

PYTHON_FILES = ("torch/distributed/",)  # collectives, c10d_logger, FSDP/FSDP2 hooks, DTensor


@dataclass(frozen=True)
class NativePattern:
    name: str
    regex: re.Pattern[str]
    what: str  # what a rank waiting there waits in, for a person


def _p(name: str, regex: str, what: str) -> NativePattern:
    return NativePattern(name, re.compile(regex), what)


# The innermost match names the wait, except that DDP's reducer, anywhere in the stack, names
# its context (the reducer waits or issues an all_reduce from backward).
NATIVE_PATTERNS = (
    _p("gloo_transport", r"\bgloo::transport::", "gloo transport (a send/recv in flight)"),
    _p("nccl", r"\b(?:nccl|rccl)[A-Z_]\w*|\bncclKernel", "an NCCL/RCCL call"),
    _p("ddp_reducer", r"\bc10d::Reducer::", "all_reduce from backward (DDP's reducer)"),
    _p("work_wait", r"\bc10d::(?:\w+::)*\w*Work::wait\b", "a collective's Work::wait"),
    _p("process_group_gloo", r"\bc10d::ProcessGroupGloo::", "a gloo collective"),
    # torch 2.14 has a second NCCL process group in c10d::nccl2
    _p("process_group_nccl", r"\bc10d::(?:nccl2::)?ProcessGroupNCCL::", "an NCCL collective"),
    _p("c10d_dispatch", r"\bc10d::ops::|\bc10d::ProcessGroup::", "a collective being issued (c10d)"),
)


@dataclass(frozen=True)
class CollectiveWait:
    """Where a main thread waits: ``collective`` names it ("all_reduce", "all_reduce from
    backward (DDP's reducer)"), ``frame`` is the innermost frame of the collective layer,
    ``called_at`` the innermost frame of the user's code that led there."""

    collective: str
    frame: Frame
    called_at: Frame | None
    native: bool  # recognised from native frames only

    def describe(self) -> str:
        return self.collective if self.native else f"{self.collective} ({self.frame.file}:{self.frame.line})"


def is_python(f: Frame) -> bool:
    return not is_native(f)


def python_frames(frames: Sequence[Frame]) -> tuple[Frame, ...]:
    return tuple(f for f in frames if is_python(f))


def native_pattern(f: Frame) -> NativePattern | None:
    if is_python(f):
        return None
    return next((p for p in NATIVE_PATTERNS if p.regex.search(f.name)), None)


def _python_collective(f: Frame) -> bool:
    return any(p in f.file for p in PYTHON_FILES)


def _in_backward(frames: Sequence[Frame]) -> bool:
    return any(f.file.endswith(("torch/autograd/graph.py", "torch/autograd/__init__.py", "torch/_tensor.py"))
               and f.name.rsplit(".", 1)[-1] in ("backward", "_engine_run_backward") for f in frames)


def collective_wait(frames: Sequence[Frame]) -> CollectiveWait | None:
    """The collective a stack (root first, Python and native frames) waits in, or None."""
    python_hits = [i for i, f in enumerate(frames) if is_python(f) and _python_collective(f)]
    user = [f for f in frames if is_user(f)]  # not torch's, nor accelerate's or Lightning's gather
    if python_hits:
        inner = frames[python_hits[-1]]
        # the torch.distributed function the user's code (or FSDP) called: the innermost
        # one named like a collective (all_reduce, broadcast, all_gather_single...)
        name = inner.name.rsplit(".", 1)[-1]
        caller = next((f for f in reversed(frames[: python_hits[0]]) if is_user(f)), None)
        called_at = caller or (user[-1] if user else None)
        if _in_backward(frames[: python_hits[0]]):
            name = f"{name} from backward"
        return CollectiveWait(name, inner, called_at, False)
    hits = [(f, p) for f in reversed(frames) if (p := native_pattern(f)) is not None]
    if not hits:
        return None
    # DDP's reducer names the context (a wait or an issue from backward) wherever it is.
    f, pattern = next(((f, p) for f, p in hits if p.name == "ddp_reducer"), hits[0])
    return CollectiveWait(pattern.what, f, user[-1] if user else None, True)


def in_collective(frames: Sequence[Frame]) -> bool:
    return collective_wait(frames) is not None


# -- wait share ---------------------------------------------------------------------------

def python_key(sample: Sample) -> str:
    """A sample's Python stack as one string (native frames left out)."""
    return ";".join(str(f) for f in sample.frames if is_python(f))


def python_only(sample: Sample) -> Sample:
    """The sample without its native frames, as a window without ``--native`` would give it."""
    if all(is_python(f) for f in sample.frames):
        return sample
    parts = sample.folded.split(";")
    head = [parts[0]] if parts and parts[0].startswith("thread (") else []
    kept = [p for p in parts[len(head):] if is_python(parse_frame(p))]
    frames = python_frames(sample.frames)
    return Sample(sample.thread, sample.main, frames, sample.count, ";".join(head + kept))


class WaitRatios:
    """How much of the time spent at each Python stack is a collective wait, learned from
    a rank's native windows and applied to its plain windows.

    A native window (``py-spy record --native``) shows, per sample, whether the thread
    was in the collective layer. Per Python stack it gives the share of samples that
    were: about 0.85 for a DDP rank waiting for a straggler at ``_engine_run_backward``,
    0.03 for the straggler itself at the same line. A plain window's sample then counts
    for that share; a stack never seen natively counts 1 if its Python frames are in
    ``torch.distributed``, else 0. A stack seen again is averaged with what it was.
    """

    def __init__(self, max_stacks: int = 256) -> None:
        self.max_stacks = max_stacks
        self._ratio: dict[str, float] = {}
        self.learned = False

    def learn(self, native_main: Iterable[Sample]) -> None:
        waits: dict[str, int] = {}
        totals: dict[str, int] = {}
        for s in native_main:
            key = python_key(s)
            totals[key] = totals.get(key, 0) + s.count
            if in_collective(s.frames):
                waits[key] = waits.get(key, 0) + s.count
        for key, n in totals.items():
            old = self._ratio.pop(key, None)
            new = waits.get(key, 0) / n
            # averaged with what earlier windows said: one short window is noisy under load
            self._ratio[key] = new if old is None else (old + new) / 2
        while len(self._ratio) > self.max_stacks:  # forget the oldest
            del self._ratio[next(iter(self._ratio))]
        self.learned = True

    def ratio(self, sample: Sample) -> float:
        known = self._ratio.get(python_key(sample))
        if known is not None:
            return known
        return 1.0 if any(_python_collective(f) for f in sample.frames) else 0.0

    def waits(self, plain_main: Iterable[Sample]) -> float:
        return sum(s.count * self.ratio(s) for s in plain_main)

    @property
    def table(self) -> Mapping[str, float]:
        return dict(self._ratio)


def native_waits(native_main: Iterable[Sample]) -> int:
    """Samples of a native window in the collective layer (Python or native frames)."""
    return sum(s.count for s in native_main if in_collective(s.frames))


# The interpreter and the C library: native frames under a Python line that say it runs
# Python code (a loop spinning at that line) or sleeps in a system call, not that a C++ call computes.
_PLAIN_NATIVE = re.compile(r"\((?:lib)?python[\d.]*(?:\.so[\d.]*)?\)$|\(libc\.so[\d.]*\)$|\(libpthread[^)]*\)$")


def _computing_key(frames: Sequence[Frame]) -> str:
    """A native stack as the place it computes: where it stands (analysis.stacks.standing_key)
    and the native frames below its innermost Python frame, without the interpreter's and
    libc's (which change with every bytecode of a spinning loop)."""
    last = max((i for i, f in enumerate(frames) if is_python(f)), default=-1)
    tail = [f.name for f in frames[last + 1:]
            if f.file == "" and not _PLAIN_NATIVE.search(f.name)]
    return standing_key(frames) + "|" + ";".join(tail)


def moving(native_main: Sequence[Sample], dominant: Sequence[Frame]) -> bool:
    """Native stacks that change, the most sampled (``dominant``) outside any collective: the
    thread computes (one long C++ call under one Python line, e.g. a slow backward). A thread
    that spent most of the window in a collective waits: it is not moving even if its
    innermost frames spin, or it computed before it blocked there (a DDP rank mid-window).
    A loop spinning in Python at one place, or a wait in a system call, is not moving either:
    only the interpreter's or libc's frames change under it."""
    return len({_computing_key(s.frames) for s in native_main}) > 1 and not in_collective(dominant)


# -- py-spy dump text and JSON ----------------------------------------------------------------

@dataclass(frozen=True)
class DumpThread:
    tid: str
    name: str
    state: str  # py-spy's: "idle", "active", "active+gil"...
    frames: tuple[Frame, ...]  # root first


_DUMP_THREAD = re.compile(r'^Thread (?P<tid>\S+) \((?P<state>[\w+]+)\)(?:: "(?P<name>.*)")?\s*$')


def parse_dump_text(text: str) -> list[DumpThread]:
    """Threads of ``py-spy dump [--native]`` text output (frames printed innermost first)."""
    threads: list[DumpThread] = []
    head: re.Match[str] | None = None
    frames: list[Frame] = []

    def close() -> None:
        if head is not None:
            threads.append(DumpThread(head.group("tid"), head.group("name") or "", head.group("state"),
                                      tuple(reversed(frames))))

    for line in text.splitlines():
        m = _DUMP_THREAD.match(line)
        if m is not None:
            close()
            head, frames = m, []
        elif head is not None and line.startswith("    ") and not line.startswith("        "):
            frames.append(parse_frame(line.strip()))
    close()
    return threads


def frames_from_json(thread: Mapping[str, object]) -> tuple[Frame, ...]:
    """Root-first frames of one thread of ``py-spy dump --json [--native]``."""
    out = []
    for f in thread.get("frames") or ():  # type: ignore[union-attr]
        if not isinstance(f, dict):
            continue
        name, short = str(f.get("name", "")), str(f.get("short_filename") or f.get("filename") or "")
        line = f.get("line") if isinstance(f.get("line"), int) else 0
        if f.get("module"):  # a native frame
            out.append(Frame(f"{name} ({short})", "", 0))
        else:
            out.append(Frame(name, short, line))
    return tuple(reversed(out))

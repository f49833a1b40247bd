"""What the timeline probes in libtorch, and where exactly.

Every probe is an entry probe: a return probe (uretprobe) replaces the return address,
and a C++ exception thrown through it finds no unwind data and aborts the process
(checked: a backward that raises then ends the job with SIGABRT). So the end of a
backward is the entry of ``DelayWarningHandler::replay_warnings``, which
``Engine::execute`` calls once the graph is done, and the end of a ``record_function``
block is its exit function.

A probe is placed only on an instruction the kernel emulates on x86-64 (a push, or a
jmp): any other is single-stepped out of line, ten times dearer per hit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from profagent.analysis import timeline as tl

# Every probe records 16 bytes: the name's head for rf_enter, two registers (no memory
# read) for the others. With one record size the reader reads a ring's records as one
# array (system.perfevents) instead of one at a time, at a fifth of the agent's CPU.
NAME_HEAD = "head0=+0(+0(%si)):u64 head1=+8(+0(%si)):u64"
PADDING = "pad0=%ax:u64 pad1=%ax:u64"


@dataclass(frozen=True)
class ProbeSpec:
    key: str  # the event name in our group (a library index is appended)
    kind: str  # the timeline event kind it gives
    pattern: re.Pattern[bytes]  # the mangled names it takes
    fetchargs: str = PADDING
    collective: str = ""  # the collective's name, for COLLECTIVE probes
    required: bool = False  # without it the library is not probed at all


# The collectives DDP, FSDP and FSDP2 call, and barrier: (the process group's method, the
# collective's name). torch 2.14 renamed the one-tensor ones (``_allgather_base`` became
# ``all_gather_single``...): a build has one name or the other, and both are looked for.
# Each probe costs the kernel about 0.1 s to disarm when the agent stops (it visits every
# process mapping the library), so the rarely used ones (gather, scatter, alltoall...) are
# left out.
_OPS = (
    ("allreduce", "allreduce"), ("allreduce_coalesced", "allreduce_coalesced"), ("broadcast", "broadcast"),
    ("allgather", "allgather"), ("_allgather_base", "allgather_base"), ("all_gather_single", "allgather_base"),
    ("allgather_into_tensor_coalesced", "allgather_into_tensor_coalesced"),
    ("all_gather_single_coalesced", "allgather_into_tensor_coalesced"),
    ("reduce_scatter", "reduce_scatter"), ("_reduce_scatter_base", "reduce_scatter_base"),
    ("reduce_scatter_single", "reduce_scatter_base"),
    ("reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_coalesced"),
    ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"),
    ("barrier", "barrier"),
)
# The process group classes: (probe key prefix, mangled class). torch 2.14's libtorch_cuda.so
# has a second NCCL process group, c10d::nccl2::ProcessGroupNCCL, beside the first.
_GROUPS = (("gloo", "4c10d16ProcessGroupGloo"), ("nccl", "4c10d16ProcessGroupNCCL"),
           ("nccl2", "4c10d5nccl216ProcessGroupNCCL"))


def _collective(prefix: str, group: str, method: str, collective: str) -> ProbeSpec:
    # ending in its options (``const ReduceScatterOptions&``...): the method that overrides
    # c10d::Backend's, not a helper of the same name (nccl2 has a reduce_scatter of its own)
    pattern = re.compile(rb"_ZN" + group.encode() + f"{len(method)}{method}".encode() + rb"E[A-Za-z0-9_]*OptionsE")
    return ProbeSpec(f"{prefix}_{method.strip('_')}"[:40], tl.COLLECTIVE, pattern, collective=collective)


PROBES: tuple[ProbeSpec, ...] = (
    # The name is a `const std::string&`; the return value is a class, so its address
    # comes first (%di) and the name second (%si). The first 16 bytes tell the kind.
    ProbeSpec("rf_enter", tl.RECORD, re.compile(
        rb"_ZN5torch8autograd8profiler25record_function_enter_newERKNSt7__cxx1112basic_string[A-Za-z0-9_]*"),
        fetchargs=NAME_HEAD, required=True),
    ProbeSpec("rf_exit", tl.RECORD_EXIT, re.compile(
        rb"_ZN5torch8autograd8profilerL?24record_function_exit_newERKN3c1013intrusive_ptr[A-Za-z0-9_]*"),
        required=True),
    ProbeSpec("bwd", tl.BACKWARD, re.compile(rb"_ZN5torch8autograd6Engine7executeE[A-Za-z0-9_]*")),
    ProbeSpec("bwd_end", tl.BACKWARD_END, re.compile(
        rb"_ZN5torch8autograd5utils19DelayWarningHandler15replay_warningsEv")),
    # gloo's process group lives in libtorch_cpu.so, NCCL's in libtorch_cuda.so; the names
    # are torch's own (ProcessGroup*.hpp), checked against real builds (tests/unit/fixtures/
    # torch_symbols), and probed where a library has them
    *(_collective(prefix, group, method, collective) for prefix, group in _GROUPS for method, collective in _OPS),
)

LIBRARY_NAMES = re.compile(r"(^|/)lib(torch_cpu|torch_cuda|torch)\.so(\.[0-9.]+)?$")


def probe_offset(code: bytes, kind: str) -> int | None:
    """Where in a function to place its probe (bytes from its start), or None when its
    first instructions are not ones the kernel emulates (x86-64)."""
    at = 4 if code.startswith(b"\xf3\x0f\x1e\xfa") else 0  # endbr64: step over it
    head = code[at:]
    if head[:1] and 0x50 <= head[0] <= 0x57:  # push %rbp, %rbx...
        return at
    if head[:1] == b"\x41" and len(head) > 1 and 0x50 <= head[1] <= 0x57:  # push %r8..%r15
        return at
    if head[:1] == b"\xe9":  # jmp rel32: a tail call
        return at
    if kind == tl.RECORD_EXIT and len(head) >= 8 and head[:3] == b"\x48\x8b\x3f" \
            and head[3:6] == b"\x48\x83\xc7" and head[7] == 0xE9:
        # mov (%rdi),%rdi; add $N,%rdi; jmp RecordFunction::end: probe the jmp
        return at + 7
    return None

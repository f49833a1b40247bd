"""The functions of a real torch build that the timeline probes care about: every method of
the process group classes and the autograd functions, with each one's first bytes.

A torch release may rename what the probes look for (2.14 renamed ``_allgather_base`` to
``all_gather_single``), so tests/unit/test_timeline_builds.py checks the probes against
real builds: the installed one, read here, and others kept as fixtures
(tests/unit/fixtures/torch_symbols/), written by running this file on a wheel's libraries:

    unzip -q torch-2.14.1-...whl 'torch/lib/libtorch_cpu.so' 'torch/lib/libtorch_cuda.so'
    python tests/helpers/torch_symbols.py torch/lib/libtorch_cpu.so torch/lib/libtorch_cuda.so \\
        > tests/unit/fixtures/torch_symbols/torch-2.14.1-cu13.tsv

Each line: the library's file name, the mangled name, its first bytes (hex).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from profagent.system import elfsyms

# Every method of c10d's gloo and NCCL process groups (torch 2.14 has a second NCCL one,
# in c10d::nccl2), and every function of the autograd engine and record_function: wider
# than what the probes take, so that a renamed method shows up as one nobody looks for.
CLASS_METHOD = re.compile(rb"_ZN4c10d(?:5nccl2)?16ProcessGroup(?:Gloo|NCCL)(\d+)([A-Za-z_][A-Za-z0-9_]*)E[A-Za-z0-9_]*")
AUTOGRAD = re.compile(rb"_ZN5torch8autograd(?:6Engine7execute|8profilerL?\d+record_function_\w+|"
                      rb"5utils19DelayWarningHandler15replay_warnings)E?[A-Za-z0-9_]*")
PATTERNS = {"class": CLASS_METHOD, "autograd": AUTOGRAD}


def read_build(path: Path) -> list[tuple[str, str, bytes]]:
    """(library file name, mangled name, first bytes) of every such function in ``path``."""
    with path.open("rb") as fh:
        library = elfsyms.read_functions(fh, PATTERNS)
    return sorted((path.name, f.name, f.code) for functions in library.functions.values() for f in functions)


def load_fixture(path: Path) -> list[tuple[str, str, bytes]]:
    rows = []
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            library, name, code = line.split("\t")
            rows.append((library, name, bytes.fromhex(code)))
    return rows


def method_of(name: str) -> tuple[str, str] | None:
    """(the mangled class, the method): ``("_ZN4c10d16ProcessGroupGloo", "allreduce")`` for
    ``_ZN4c10d16ProcessGroupGloo9allreduceE...``; None for another name. The length prefix
    says where the method's name ends."""
    m = CLASS_METHOD.fullmatch(name.encode())
    if m is None:
        return None
    length = int(m.group(1))
    tail = name.encode()[m.start(2):]
    # a nested name (ProcessGroupNCCL::Options::Options) goes on after it: not a method
    return (name[:m.start(1)], tail[:length].decode()) if tail[length:length + 1] == b"E" else None


if __name__ == "__main__":
    print("# written by tests/helpers/torch_symbols.py from " + ", ".join(Path(p).name for p in sys.argv[1:]))
    for library, name, code in (row for p in sys.argv[1:] for row in read_build(Path(p))):
        print(f"{library}\t{name}\t{code.hex()}")

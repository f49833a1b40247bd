"""The timeline's probes against real torch builds: the installed one (its libtorch_cpu.so,
read here) and torch 2.14.1's CUDA wheel (libtorch_cpu.so and libtorch_cuda.so, with both of
its NCCL process groups), kept as a fixture written by tests/helpers/torch_symbols.py.

A release may rename what the probes look for: torch 2.14 renamed ``_allgather_base`` to
``all_gather_single``, and FSDP2's collectives went unseen until the probes took both names.
Every collective method of each process group class is therefore either probed or left out
on purpose here, and a new one fails this file until it is one or the other.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from helpers.torch_symbols import load_fixture, method_of, read_build
from profagent.sources.timeline.probes import PROBES, probe_offset

FIXTURES = Path(__file__).parent / "fixtures" / "torch_symbols"


def _installed() -> list[tuple[str, str, bytes]]:
    # found, not imported (seconds of CPU); the test extras install torch
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("torch is not installed here: `make venv` installs the test extras")
    return read_build(Path(spec.submodule_search_locations[0]) / "lib" / "libtorch_cpu.so")


BUILDS = {"installed": _installed, "torch-2.14.1-cu13": lambda: load_fixture(FIXTURES / "torch-2.14.1-cu13.tsv")}

# Methods of the process groups that take options but are not probed: collectives a
# training step rarely calls (each probe adds about 0.1 s to the agent's stop), helpers of
# a probed one (probing both would count one arrival twice), and what is no collective.
LEFT_OUT = {
    "allgather_coalesced", "allreduce_sparse", "alltoall", "alltoall_base", "all_to_all_single", "gather",
    "gather_single", "scatter", "reduce",
    "allreduce_impl", "_broadcast_oop", "_reduce_oop",  # 2.14's NCCL: allreduce's helper, out-of-place variants
    "allocateTensor", "reconfigure",
}
# What DDP (allreduce, broadcast), FSDP (the one-tensor and coalesced ones) and
# torch.distributed.barrier call: every process group class must give each of them.
TRAINING = {"allreduce", "allreduce_coalesced", "broadcast", "allgather", "allgather_base",
            "allgather_into_tensor_coalesced", "reduce_scatter", "reduce_scatter_base",
            "reduce_scatter_tensor_coalesced", "barrier"}


def _probe_of(name: str):
    return next((spec for spec in PROBES if spec.pattern.fullmatch(name.encode())), None)


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_every_collective_of_a_real_build_is_probed_or_left_out_on_purpose(build: str) -> None:
    rows = BUILDS[build]()
    classes: dict[str, dict[str, str]] = {}  # class -> method -> the collective probed ("" if none)
    for _library, name, _code in rows:
        of = method_of(name)
        if of is None or not name.endswith("OptionsE"):  # a collective takes its options last
            continue
        spec = _probe_of(name)
        classes.setdefault(of[0], {})[of[1]] = spec.collective if spec is not None else ""
    assert len(classes) == (1 if build == "installed" else 3), sorted(classes)  # gloo; gloo, NCCL, nccl2
    for cls, methods in classes.items():
        unknown = sorted(m for m, probed in methods.items() if not probed and m not in LEFT_OUT)
        assert not unknown, f"{build}: {cls} has collectives nobody probes: {unknown}"
        assert set(methods.values()) >= TRAINING, f"{build}: {cls} lacks {sorted(TRAINING - set(methods.values()))}"


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_every_probe_takes_one_function_of_a_real_build_at_an_instruction_the_kernel_emulates(build: str) -> None:
    rows = BUILDS[build]()
    taken: dict[tuple[str, str], list[str]] = {}
    for library, name, code in rows:
        spec = _probe_of(name)
        if spec is None:
            continue
        taken.setdefault((library, spec.key), []).append(name)
        assert probe_offset(code, spec.kind) is not None, (build, name, code.hex())
    assert all(len(names) == 1 for names in taken.values()), {k: v for k, v in taken.items() if len(v) > 1}
    # the step and its stages come from libtorch_cpu.so, in every build
    assert {"rf_enter", "rf_exit", "bwd", "bwd_end"} <= {key for library, key in taken if library == "libtorch_cpu.so"}

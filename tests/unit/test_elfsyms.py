"""Reading a mapped library's function symbols (system/elfsyms.py): right on real libraries,
checked against pyelftools' own reading, and one ElfError, fast, for every damaged or
hostile file (a rank may map any file under a library's name)."""

from __future__ import annotations

import ctypes.util
import re
import struct
import time
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from helpers.fake_libtorch import RF_ENTER, repeated_name
from profagent.system import elfsyms

LIBC = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")


def _libc() -> bytes:
    path = LIBC if LIBC.is_file() else Path(ctypes.util.find_library("c") or "")
    if not path.is_file():
        pytest.fail("no libc.so.6 to read (this test reads the system's C library)")
    return path.read_bytes()


def _read(tmp_path: Path, data: bytes, patterns: dict | None = None) -> elfsyms.Library:
    path = tmp_path / "libtorch_cpu.so"
    path.write_bytes(data)
    with path.open("rb") as fh:
        return elfsyms.read_functions(fh, patterns or {"f": re.compile(rb"getppid")})


def test_a_real_library_gives_the_functions_and_build_id_pyelftools_sees(tmp_path: Path) -> None:
    data = _libc()
    # fork, getpid and execve are stored as the tails of vfork, __getpid and fexecve
    names = ("getppid", "fork", "getpid", "execve", "pthread_create", "qsort")
    lib = _read(tmp_path, data, {name: re.compile(re.escape(name.encode())) for name in names})
    with (tmp_path / "libtorch_cpu.so").open("rb") as fh:
        elf = ELFFile(fh)
        build_id = next(str(n["n_desc"]) for s in elf.iter_sections() if s["sh_type"] == "SHT_NOTE"
                        for n in s.iter_notes() if n["n_type"] == "NT_GNU_BUILD_ID")
        dynsym = elf.get_section_by_name(".dynsym")
        want = {s.name: s["st_value"] for s in dynsym.iter_symbols()
                if s.name in names and s["st_info"]["type"] == "STT_FUNC" and s["st_value"]}
    assert lib.machine == "EM_X86_64" and lib.build_id == build_id
    got = {f.name for fs in lib.functions.values() for f in fs}
    assert got == set(want), (got, want)
    assert len(want) == len(names)
    (getppid,) = lib.functions["getppid"]
    assert data[getppid.file_offset:getppid.file_offset + elfsyms.CODE_BYTES] == getppid.code


def _patched(data: bytes, offset: int, fmt: str, *values: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, *values)
    return bytes(out)


def _section_header_at(data: bytes, index: int) -> int:
    shoff, = struct.unpack_from("<Q", data, 0x28)
    return shoff + 64 * index


def _dynstr_index(data: bytes) -> int:
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shnum, shstrndx = struct.unpack_from("<HH", data, 0x3C)
    names_off, = struct.unpack_from("<Q", data, shoff + 64 * shstrndx + 24)
    for i in range(shnum):
        name, = struct.unpack_from("<I", data, shoff + 64 * i)
        if data[names_off + name:names_off + name + 8] == b".dynstr\x00":
            return i
    raise AssertionError("no .dynstr")


CASES = {
    "empty": lambda d: b"",
    "not ELF": lambda d: b"\x7fELF" + b"\xff" * 200,
    "truncated headers": lambda d: d[:64],
    "32-bit": lambda d: _patched(d, 4, "<B", 1),
    "big-endian": lambda d: _patched(d, 5, "<B", 2),
    "section table past the end": lambda d: _patched(d, 0x28, "<Q", len(d) + 4096),
    "section entries of 40 bytes": lambda d: _patched(d, 0x3A, "<H", 40),
    "a million sections": lambda d: _patched(_patched(d, 0x3C, "<H", 0), _section_header_at(d, 0) + 32, "<Q", 1 << 20),
    "name table index out of range": lambda d: _patched(d, 0x3E, "<H", 0xFFF0),
    "a 1 TiB string table": lambda d: _patched(d, _section_header_at(d, _dynstr_index(d)) + 32, "<Q", 1 << 40),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_library_is_one_elf_error_and_quick(tmp_path: Path, case: str) -> None:
    data = CASES[case](_libc())
    began = time.monotonic()
    with pytest.raises(elfsyms.ElfError):
        _read(tmp_path, data)
    assert time.monotonic() - began < 5.0


def test_strings_and_notes_that_point_anywhere_read_as_nothing(tmp_path: Path) -> None:
    data = _libc()
    # every section's name past the name table's end, and every note's sizes huge
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shnum, = struct.unpack_from("<H", data, 0x3C)
    out = bytearray(data)
    for i in range(shnum):
        struct.pack_into("<I", out, shoff + 64 * i, 0xFFFFFF00)
        kind, = struct.unpack_from("<I", data, shoff + 64 * i + 4)
        if kind == 7:  # SHT_NOTE: its first note claims 4 GiB of name and of description
            at, = struct.unpack_from("<Q", data, shoff + 64 * i + 24)
            struct.pack_into("<II", out, at, 0xFFFFFFF0, 0xFFFFFFF0)
    lib = _read(tmp_path, bytes(out))
    assert lib.build_id == "" and lib.functions == {"f": ()}  # no section found by name: nothing read


def _crafted(strtab_bytes: int, nul: bool) -> bytes:
    return repeated_name(strtab_bytes, nul)


def _cost(tmp_path: Path, data: bytes) -> tuple[float, int, elfsyms.Library]:
    """(CPU seconds, tracemalloc peak bytes, the library) of reading ``data``, best of 3."""
    import tracemalloc

    from profagent.sources.timeline.probes import PROBES

    patterns = {spec.key: spec.pattern for spec in PROBES}
    path = tmp_path / "libtorch_cpu.so"
    path.write_bytes(data)
    best, peak = float("inf"), 0
    for _ in range(3):
        tracemalloc.start()
        began = time.process_time()
        with path.open("rb") as fh:
            lib = elfsyms.read_functions(fh, patterns)
        best = min(best, time.process_time() - began)
        peak = max(peak, tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    return best, peak, lib


@pytest.mark.parametrize("size", [512 << 10, 1 << 20])
def test_a_name_repeated_without_nul_costs_what_an_honest_table_of_its_size_does(tmp_path: Path, size: int) -> None:
    """Issue 51 High 2: a string table repeating a probed name with no NUL made every copy
    a scan to the table's end, each name kept (0.5 MiB: 25 s and 3.2 GB). Now time and
    memory are linear in the file: side by side with the same table NUL-terminated (the
    linear baseline), and doubling the table about doubles the time, not quadruples it."""
    honest_s, honest_peak, honest = _cost(tmp_path, _crafted(size, nul=True))
    attack_s, attack_peak, attack = _cost(tmp_path, _crafted(size, nul=False))
    half_s, _, _ = _cost(tmp_path, _crafted(size // 2, nul=False))
    print(f"{size >> 10} KiB: honest {honest_s * 1e3:.1f} ms, {honest_peak >> 10} KiB; attack {attack_s * 1e3:.1f} ms, "
          f"{attack_peak >> 10} KiB; half the attack {half_s * 1e3:.1f} ms")
    data_bytes = len(_crafted(size, nul=False))
    assert attack_s <= 3 * honest_s + 0.05
    assert attack_s <= 3 * half_s + 0.05  # quadratic would be 4x
    assert attack_peak <= 4 * data_bytes and honest_peak <= 4 * data_bytes
    # the honest table's 1,000 symbols name one function; the attack's names run past MAX_NAME
    assert [f.name for f in honest.functions["rf_enter"]] == [RF_ENTER.decode()]
    assert attack.functions["rf_enter"] == ()


def test_a_parse_past_its_deadline_is_one_elf_error(tmp_path: Path) -> None:
    path = tmp_path / "libtorch_cpu.so"
    path.write_bytes(_crafted(64 << 10, nul=True))
    with path.open("rb") as fh, pytest.raises(elfsyms.ElfError, match="took too long"):
        elfsyms.read_functions(fh, {"f": re.compile(re.escape(RF_ENTER))}, deadline=time.monotonic() - 1)

"""Files an attacker maps under libtorch's name: junk that is no library, small ELF files
that hold torch's record_function entry and exit, each on a ``push %rbp`` (so the agent
places probes on them), and a string table that repeats a probed name, for the
timeline's attacker tests and the symbol reader's unit tests."""

from __future__ import annotations

import struct

# names the timeline probes (sources/timeline/probes.py), as libtorch_cpu.so spells them
RF_ENTER = (b"_ZN5torch8autograd8profiler25record_function_enter_newERKNSt7__cxx1112basic_stringIcSt11char_"
            b"traitsIcESaIcEEERKSt8optionalIN3c106IValueEE")
RF_EXIT = b"_ZN5torch8autograd8profiler24record_function_exit_newERKN3c1013intrusive_ptrINS_6detail6RecordEEE"


def junk(seed: int) -> bytes:
    """4 KiB that start like an ELF file and are none."""
    return b"\x7fELF" + bytes([seed % 251 + 1]) * 4092


def probeable(seed: int) -> bytes:
    """An x86-64 ELF file of 8 KiB whose .dynsym names RF_ENTER and RF_EXIT, each a
    function starting with ``push %rbp`` in one executable PT_LOAD; ``seed`` makes its
    bytes (and build) its own."""
    code_at = 0x1000
    code = b"\x55\xc3" + bytes(14) + b"\x55\xc3" + struct.pack("<I", seed) + bytes(0x1000 - 22)
    strtab = b"\x00" + RF_ENTER + b"\x00" + RF_EXIT + b"\x00"
    syms = bytes(24) + struct.pack("<IBBHQQ", 1, 0x12, 0, 1, code_at, 2) \
        + struct.pack("<IBBHQQ", 2 + len(RF_ENTER), 0x12, 0, 1, code_at + 16, 2)
    shstr = b"\x00.dynsym\x00.dynstr\x00.shstrtab\x00.text\x00"
    sym_at = 64 + 56
    str_at = sym_at + len(syms)
    shstr_at = str_at + len(strtab)
    assert shstr_at + len(shstr) < code_at
    sh_at = code_at + len(code)
    end = sh_at + 5 * 64

    def section(name: int, kind: int, offset: int, size: int, link: int = 0, entsize: int = 0, flags: int = 0) -> bytes:
        return struct.pack("<IIQQQQIIQQ", name, kind, flags, offset, offset, size, link, 0, 8, entsize)

    ehdr = b"\x7fELF\x02\x01\x01" + bytes(9) + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 64, sh_at, 0, 64, 56, 1,
                                                           64, 5, 3)
    phdr = struct.pack("<IIQQQQQQ", 1, 5, 0, 0, 0, end, end, 0x1000)  # PT_LOAD, R+X, the whole file
    head = ehdr + phdr + syms + strtab + shstr
    headers = (section(0, 0, 0, 0) + section(1, 11, sym_at, len(syms), 2, 24) + section(9, 3, str_at, len(strtab))
               + section(17, 3, shstr_at, len(shstr)) + section(27, 1, code_at, len(code), flags=6))
    return head + bytes(code_at - len(head)) + code + headers


def repeated_name(strtab_bytes: int, nul: bool) -> bytes:
    """A small ELF file whose .dynstr repeats RF_ENTER to ``strtab_bytes``, each copy ended
    by a NUL (an honest table) or none (the attack: every copy's name runs to the table's
    end), with 1,000 function symbols naming copies, and one executable PT_LOAD covering
    the file."""
    unit = RF_ENTER + (b"\x00" if nul else b"")
    strtab = b"\x00" + unit * (strtab_bytes // len(unit))
    syms = b"".join(struct.pack("<IBBHQQ", 1 + i * len(unit), 0x12, 0, 1, 0x100 + i, 16) for i in range(1000))
    shstr = b"\x00.dynsym\x00.dynstr\x00.shstrtab\x00"
    sym_at = 64 + 56
    str_at = sym_at + len(syms)
    shstr_at = str_at + len(strtab)
    sh_at = (shstr_at + len(shstr) + 7) // 8 * 8
    end = sh_at + 4 * 64

    def section(name: int, kind: int, offset: int, size: int, link: int = 0, entsize: int = 0) -> bytes:
        return struct.pack("<IIQQQQIIQQ", name, kind, 0, 0, offset, size, link, 0, 8, entsize)

    ehdr = b"\x7fELF\x02\x01\x01" + bytes(9) + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 64, sh_at, 0, 64, 56, 1,
                                                           64, 4, 3)
    phdr = struct.pack("<IIQQQQQQ", 1, 5, 0, 0, 0, end, end, 4096)  # PT_LOAD, R+X, the whole file
    data = ehdr + phdr + syms + strtab + shstr
    headers = (section(0, 0, 0, 0) + section(1, 11, sym_at, len(syms), 2, 24) + section(9, 3, str_at, len(strtab))
               + section(17, 3, shstr_at, len(shstr)))
    return data + bytes(sh_at - len(data)) + headers

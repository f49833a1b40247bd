"""Function symbols of a mapped library, as file offsets a uprobe can take.

The library comes from a process we observe, so its bytes are hostile: pyelftools reads
the headers, every section we read whole is capped (``MAX_SECTION``), and anything
malformed is one ``ElfError``. Names are matched by regular expression against both the
dynamic and the full symbol table (``.symtab``, when the build kept it), so any torch
wheel that exports or keeps the symbol can be probed without importing torch.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import BinaryIO

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

MAX_SECTION = 256 << 20  # bytes of one symbol or string table we read
CODE_BYTES = 16  # bytes read at each function's start, to check its first instructions
_SYM64 = struct.Struct("<IBBHQQ")  # st_name, st_info, st_other, st_shndx, st_value, st_size
STT_FUNC = 2


class ElfError(Exception):
    """The file is not an ELF library we can read symbols from (the reason is the message)."""


@dataclass(frozen=True)
class Function:
    name: str  # the mangled name
    file_offset: int  # where its first instruction lies in the file
    code: bytes  # its first CODE_BYTES bytes


@dataclass(frozen=True)
class Library:
    machine: str  # EM_X86_64, EM_AARCH64...
    build_id: str  # hex, "" when the file has none
    functions: Mapping[str, tuple[Function, ...]]  # pattern -> the functions matching it


def read_functions(fh: BinaryIO, patterns: Mapping[str, re.Pattern[bytes]]) -> Library:
    """Every function of the file whose mangled name matches one of ``patterns`` (full
    match), in the dynamic and the full symbol table. Raises ElfError."""
    try:
        elf = ELFFile(fh)
        if elf.elfclass != 64 or not elf.little_endian:
            raise ElfError("not a 64-bit little-endian ELF file")
        segments = [(s["p_vaddr"], s["p_memsz"], s["p_offset"], s["p_filesz"]) for s in elf.iter_segments()
                    if s["p_type"] == "PT_LOAD" and s["p_flags"] & 1]  # PF_X: code
        found: dict[str, dict[str, Function]] = {key: {} for key in patterns}
        for table, strings in ((".dynsym", ".dynstr"), (".symtab", ".strtab")):
            symtab, strtab = elf.get_section_by_name(table), elf.get_section_by_name(strings)
            if symtab is None or strtab is None:
                continue
            names = _section_bytes(fh, strtab)
            wanted = _names(names, patterns)
            if not wanted:
                continue
            for st_name, st_info, _, shndx, value, _ in _SYM64.iter_unpack(_section_bytes(fh, symtab, whole=True)):
                key_name = wanted.get(st_name)
                if key_name is None or st_info & 0xF != STT_FUNC or shndx == 0 or value == 0:
                    continue
                key, name = key_name
                offset = _file_offset(segments, value)
                if offset is not None and name not in found[key]:
                    found[key][name] = Function(name, offset, _read_at(fh, offset, CODE_BYTES))
        return Library(elf.header["e_machine"], _build_id(elf),
                       {k: tuple(v.values()) for k, v in found.items()})
    except ElfError:
        raise
    except (ELFError, struct.error, ValueError, KeyError, TypeError, OSError, AttributeError) as exc:
        raise ElfError(f"malformed ELF file ({type(exc).__name__})") from exc


def _section_bytes(fh: BinaryIO, section: object, whole: bool = False) -> bytes:
    size = section["sh_size"]  # type: ignore[index]
    if size > MAX_SECTION:
        raise ElfError(f"a symbol section of {size} bytes is over the {MAX_SECTION >> 20} MiB cap")
    data = _read_at(fh, section["sh_offset"], size)  # type: ignore[index]
    if whole and len(data) % _SYM64.size:
        data = data[: len(data) - len(data) % _SYM64.size]
    return data


def _read_at(fh: BinaryIO, offset: int, size: int) -> bytes:
    return os.pread(fh.fileno(), size, offset)


def _names(strtab: bytes, patterns: Mapping[str, re.Pattern[bytes]]) -> dict[int, tuple[str, str]]:
    """String-table offset -> (pattern key, name) for every name matching a pattern. Each
    pattern's literal head is found with bytes.find (tables run to 100 MB)."""
    out: dict[int, tuple[str, str]] = {}
    for key, pattern in patterns.items():
        head = b"\x00" + _literal_head(pattern.pattern)
        i = strtab.find(head)
        while i >= 0:
            end = strtab.find(b"\x00", i + 1)
            name = strtab[i + 1:end if end >= 0 else len(strtab)]
            if pattern.fullmatch(name):
                out[i + 1] = (key, name.decode("ascii", "replace"))
            i = strtab.find(head, i + 1)
    return out


def _literal_head(pattern: bytes) -> bytes:
    for i, c in enumerate(pattern):
        if c in b".^$*+?{}[]\\|()":
            return pattern[:i]
    return pattern


def _file_offset(segments: list[tuple[int, int, int, int]], vaddr: int) -> int | None:
    for start, memsz, offset, filesz in segments:
        if start <= vaddr < start + min(memsz, filesz):
            return vaddr - start + offset
    return None


def _build_id(elf: ELFFile) -> str:
    for section in elf.iter_sections():
        if section["sh_type"] == "SHT_NOTE":
            for note in section.iter_notes():
                if note["n_type"] == "NT_GNU_BUILD_ID":
                    return str(note["n_desc"])[:80]
    return ""

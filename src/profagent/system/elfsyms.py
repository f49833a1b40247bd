"""Function symbols of a mapped library, as file offsets a uprobe can take.

The library comes from a process we observe, so its bytes are hostile: pyelftools reads
the ELF header, the section header table is read whole (``MAX_SECTIONS``), every section
we read whole is capped (``MAX_SECTION``), and anything malformed is one ``ElfError``.
Names are matched by regular expression against both the dynamic and the full symbol table (``.symtab``, when the build kept it), so any torch
wheel that exports or keeps the symbol can be probed without importing torch.
"""

from __future__ import annotations

import os
import re
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import BinaryIO

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

MAX_SECTION = 256 << 20  # bytes of one symbol or string table we read
CODE_BYTES = 16  # bytes read at each function's start, to check its first instructions
MAX_FUNCTIONS = 64  # functions kept per pattern (the probes take the first)
MAX_NAME = 1024  # bytes of a name we match: the probed ones are under 200
HEAD_BYTES = 24  # of a pattern's literal head, searched for once for all patterns sharing them
_SYM64 = struct.Struct("<IBBHQQ")  # st_name, st_info, st_other, st_shndx, st_value, st_size
# sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, sh_info, sh_addralign, sh_entsize
_SHDR64 = struct.Struct("<IIQQQQIIQQ")
MAX_SECTIONS = 1 << 16
MAX_NOTES = 1 << 16  # bytes of one note section we read for the build id
SHN_XINDEX = 0xFFFF
SHT_NOTE = 7
NT_GNU_BUILD_ID = 3
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


def read_functions(fh: BinaryIO, patterns: Mapping[str, re.Pattern[bytes]],
                   deadline: float | None = None) -> Library:
    """Every function of the file whose mangled name matches one of ``patterns`` (full
    match), in the dynamic and the full symbol table. Raises ElfError, also once
    ``deadline`` (time.monotonic) has passed."""
    try:
        elf = ELFFile(fh)
        if elf.elfclass != 64 or not elf.little_endian:
            raise ElfError("not a 64-bit little-endian ELF file")
        segments = [(s["p_vaddr"], s["p_memsz"], s["p_offset"], s["p_filesz"]) for s in elf.iter_segments()
                    if s["p_type"] == "PT_LOAD" and s["p_flags"] & 1]  # PF_X: code
        sections = _sections(fh, elf)
        found: dict[str, dict[str, Function]] = {key: {} for key in patterns}
        for table, strings in ((".dynsym", ".dynstr"), (".symtab", ".strtab")):
            symtab, strtab = sections.get(table), sections.get(strings)
            if symtab is None or strtab is None:
                continue
            names = _section_bytes(fh, strtab)
            wanted = _names(names, patterns, deadline)
            del names
            if not wanted:
                continue
            for index, (st_name, st_info, _, shndx, value, _) in enumerate(
                    _SYM64.iter_unpack(_section_bytes(fh, symtab, whole=True))):
                if deadline is not None and not index & 0xFFFF and time.monotonic() > deadline:
                    raise ElfError("its symbol table took too long to read")
                key_name = wanted.get(st_name)
                if key_name is None or st_info & 0xF != STT_FUNC or shndx == 0 or value == 0:
                    continue
                key, name = key_name
                offset = _file_offset(segments, value)
                if offset is not None and name not in found[key] and len(found[key]) < MAX_FUNCTIONS:
                    found[key][name] = Function(name, offset, _read_at(fh, offset, CODE_BYTES))
        return Library(elf.header["e_machine"], _build_id(fh, sections),
                       {k: tuple(v.values()) for k, v in found.items()})
    except ElfError:
        raise
    except (ELFError, struct.error, ValueError, KeyError, TypeError, OSError, AttributeError) as exc:
        raise ElfError(f"malformed ELF file ({type(exc).__name__})") from exc


@dataclass(frozen=True)
class _Section:
    type: int
    offset: int
    size: int


def _sections(fh: BinaryIO, elf: ELFFile) -> dict[str, _Section]:
    """Name -> section, from the section header table read whole. Not pyelftools' section
    list: making it parses every GNU hash table in full (half the time for libtorch_cpu.so)."""
    shoff, count, names_at = elf.header["e_shoff"], elf.header["e_shnum"], elf.header["e_shstrndx"]
    if shoff == 0:
        return {}
    if elf.header["e_shentsize"] != _SHDR64.size:
        raise ElfError(f"section headers of {elf.header['e_shentsize']} bytes, not {_SHDR64.size}")
    first = _SHDR64.unpack(_read_at(fh, shoff, _SHDR64.size))
    count = count or first[5]  # more than 0xff00 sections: the count is section 0's sh_size
    if names_at == SHN_XINDEX:
        names_at = first[6]  # ... and the name table's index its sh_link
    if count > MAX_SECTIONS:
        raise ElfError(f"{count} sections, over the {MAX_SECTIONS} cap")
    table = _read_at(fh, shoff, count * _SHDR64.size)
    headers = [(h[0], _Section(h[1], h[4], h[5]))  # (where its name is, the section)
               for h in _SHDR64.iter_unpack(table[: len(table) - len(table) % _SHDR64.size])]
    if names_at >= len(headers):
        raise ElfError("no section name table")
    names = _section_bytes(fh, headers[names_at][1])
    out: dict[str, _Section] = {}
    for name_at, section in headers:
        end = names.find(b"\x00", name_at)
        out.setdefault(names[name_at:end if end >= 0 else len(names)].decode("ascii", "replace"), section)
    return out


def _section_bytes(fh: BinaryIO, section: _Section, whole: bool = False) -> bytes:
    if section.size > MAX_SECTION:
        raise ElfError(f"a symbol section of {section.size} bytes is over the {MAX_SECTION >> 20} MiB cap")
    data = _read_at(fh, section.offset, section.size)
    if whole and len(data) % _SYM64.size:
        data = data[: len(data) - len(data) % _SYM64.size]
    return data


def _read_at(fh: BinaryIO, offset: int, size: int) -> bytes:
    return os.pread(fh.fileno(), size, offset)


def _names(strtab: bytes, patterns: Mapping[str, re.Pattern[bytes]],
           deadline: float | None = None) -> dict[int, tuple[str, str]]:
    """String-table offset -> (pattern key, name) for every name matching a pattern. Names
    are found by their literal head with bytes.find (tables run to 100 MB), one pass per
    head shared by several patterns (a process group's methods): not one per pattern. A
    name may start inside another (linkers store ``fork`` as the tail of ``vfork``), so a
    head counts wherever it is. Linear in the table: each byte is searched for its NUL at
    most once (every head inside one string shares that NUL), and a name over MAX_NAME
    bytes is none of ours, so no match costs more than MAX_NAME bytes."""
    by_head: dict[bytes, list[tuple[str, re.Pattern[bytes]]]] = {}
    for key, pattern in patterns.items():
        by_head.setdefault(_literal_head(pattern.pattern)[:HEAD_BYTES], []).append((key, pattern))
    out: dict[int, tuple[str, str]] = {}
    found: dict[tuple[str, bytes], tuple[str, str]] = {}  # one value per distinct name
    size = len(strtab)
    for head, group in by_head.items():
        nul = -1  # the NUL that ends the string holding the last head seen
        scanned = 0  # no NUL lies in [searched from, scanned)
        i = strtab.find(head) if head else -1
        while i >= 0:
            if deadline is not None and time.monotonic() > deadline:
                raise ElfError("its string table took too long to read")
            if i > nul:  # a new string: find its end, never searching a byte twice
                limit = min(i + MAX_NAME + 1, size)
                at = strtab.find(b"\x00", max(i, scanned), limit)
                if at >= 0:
                    nul = at
                else:
                    scanned = limit
                    nul = size if limit == size else -1
            if nul >= 0 and nul - i <= MAX_NAME:
                name = strtab[i:nul]
                key = next((key for key, pattern in group if pattern.fullmatch(name)), None)
                if key is not None:
                    value = found.get((key, name))
                    if value is None:
                        value = found[(key, name)] = (key, name.decode("ascii", "replace"))
                    out[i] = value
            i = strtab.find(head, i + 1)
    return out


def _literal_head(pattern: bytes) -> bytes:
    """The bytes every match starts with: up to the first special character, less a
    character that a quantifier after it makes optional."""
    for i, c in enumerate(pattern):
        if c in b".^$*+?{}[]\\|()":
            return pattern[:i - 1] if c in b"*?{" and i > 0 else pattern[:i]
    return pattern


def _file_offset(segments: list[tuple[int, int, int, int]], vaddr: int) -> int | None:
    for start, memsz, offset, filesz in segments:
        if start <= vaddr < start + min(memsz, filesz):
            return vaddr - start + offset
    return None


def _build_id(fh: BinaryIO, sections: Mapping[str, _Section]) -> str:
    """The GNU build id (hex) from the file's note sections, "" when it has none."""
    for section in sections.values():
        if section.type != SHT_NOTE or section.size > MAX_NOTES:
            continue
        notes, at = _read_at(fh, section.offset, section.size), 0
        while at + 12 <= len(notes):
            name_size, desc_size, kind = struct.unpack_from("<III", notes, at)
            desc_at = at + 12 + (name_size + 3) // 4 * 4
            if kind == NT_GNU_BUILD_ID and notes[at + 12:at + 12 + name_size] == b"GNU\x00":
                return notes[desc_at:desc_at + desc_size].hex()[:80]
            at = desc_at + (desc_size + 3) // 4 * 4
    return ""

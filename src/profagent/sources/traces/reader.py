"""Reading Kineto (Chrome trace JSON) files, fast and memory-bounded.

Only what the analyzers use is decoded, piece by piece, and caps bound memory by what the
file holds, not its size. Raises ``TraceError`` (with a short bounded ``reason``) and nothing
else for bad input.
"""

from __future__ import annotations

import math
import os
import re
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from profagent.analysis.trace.model import CATEGORY_CODES, Trace  # noqa: F401  (CATEGORY_CODES: the categories kept)
from profagent.errors import SourceError
from profagent.labels import bound
from profagent.system.safefs import UnsafePath, open_regular

try:  # zlib-ng: CPython's zlib module built on zlib-ng, the same API, inflating twice as fast
    from zlib_ng import zlib_ng as zlib
except ImportError:  # a platform without its wheel: the standard library's
    import zlib  # type: ignore[no-redef]

# Only what the analyzers use is decoded: msgspec decodes events into typed Structs
# (unknown fields skipped), and the kept events become numpy columns (about 40 bytes per
# event). The ``traceEvents`` array is decoded piece by piece, cut at event boundaries
# (``}`` , ``{``; a cut inside a string or a nested object fails to decode and an earlier
# one is tried), so peak memory is one piece of text (about ``CHUNK``) plus the columns,
# never the whole text plus a dict per event. Gzip is inflated in bounded chunks too.
# Small pieces: inflated text is decoded while still in the CPU cache (a reader thread
# was slower: it waits for the GIL while msgspec decodes, and it evicts the pieces).
CHUNK = 512 * 1024
RAW_CHUNK = 1024 * 1024  # compressed bytes read at a time
MAX_BUFFERED = 16 * 1024 * 1024  # traces.max_buffered_bytes: text held at once (an event is a few KB)

WINDOW_END = "Record Window End"

# Measured on traces of small events, read and analysed in one process: a kept event costs
# about 180 bytes at the reader's and the analysis' peak, a distinct name about 2.4 bytes per
# character plus 100. The defaults hold one trace under about 256 MiB: 1 M events (~180 MB)
# plus 16,384 names of 2,048 characters (~80 MB); real traces have tens of thousands of
# events and a few hundred names (the longest kernel name seen: 1,817 characters).
MAX_EVENTS = 1_000_000
MAX_NAMES = 16_384
MAX_NAME_CHARS = 2_048
MAX_INFLATED = 512 * 1024**2


# Two caps hold whatever the file holds: ``max_bytes`` bounds the inflated text read
# (``too_large``), and ``max_buffered`` bounds the text held at once: the metadata before
# ``traceEvents``, and any one event, string or run of blanks between two event boundaries.
# A file that needs more (a gzip of a gigabyte of blanks, a 600 MiB name) is refused with
# reason ``too_large_event`` as soon as the buffer passes the cap, so the reader's peak
# memory is a small multiple of ``max_buffered`` (the text and its decoded events).
#
# What the text holds is capped too (``Limits``), since a 7 MB gzip of small valid events
# inflated to 2 GB and cost 4.5 GB of memory: events decoded (``too_many_events``), distinct
# names and distinct threads (``too_many_names``) refuse the trace as soon as they pass their
# cap; a name, pid or tid string longer than ``max_name_chars`` is cut there (+ "…"). Each
# piece of text is at most about CHUNK, so the reader holds at most one piece past a cap.
@dataclass(frozen=True)
class Limits:
    """Caps on what a trace holds (``traces.max_events``, ``max_names``, ``max_name_chars``);
    None: no cap (a file the user gave on the command line)."""

    max_events: int | None = MAX_EVENTS
    max_names: int | None = MAX_NAMES
    max_name_chars: int | None = MAX_NAME_CHARS


NO_LIMITS = Limits(None, None, None)  # libkineto's instant event at the end of the traced window


class TraceError(SourceError):
    """A trace that cannot be read. ``reason``: truncated, corrupt, not_a_trace, unreadable."""


class Args(msgspec.Struct, gc=False):
    correlation: int | str | None = -1  # absent: -1 (an explicit null stays None)
    device: int | str | None = -1
    stream: int | str | None = None
    direction: str | None = None
    total_allocated: int | None = msgspec.field(default=None, name="Total Allocated")
    device_id: int | None = msgspec.field(default=None, name="Device Id")
    device_type: int | None = msgspec.field(default=None, name="Device Type")
    name: str | None = None  # process_name / thread_name metadata
    labels: str | None = None  # process_labels metadata ("CPU", "GPU 0")


class Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    ts: float = 0.0
    dur: float | None = None  # missing or null: the event is left out and counted
    pid: int | str = 0
    tid: int | str = 0
    args: Args | None = None


class XArgs(msgspec.Struct, gc=False):
    """The args complete events need: fewer fields, faster decoding than ``Args``."""

    correlation: int | str | None = -1  # absent: -1 (an explicit null stays None)
    device: int | str | None = -1
    direction: str | None = None  # MTIA DMA: HOST_TO_DEVICE / DEVICE_TO_HOST


# The fast path: a union tagged by "ph", where only the kinds used have fields, so flow
# events and the like are skipped without building strings and floats. A piece with a
# "ph" outside this set is decoded again with the plain ``Event``.
class XEvent(msgspec.Struct, tag_field="ph", tag="X", gc=False):
    cat: str = ""
    name: str = ""
    ts: float = 0.0
    dur: float | None = None
    pid: int | str = 0
    tid: int | str = 0
    args: XArgs | None = None


class InstantEvent(msgspec.Struct, tag_field="ph", tag="i", gc=False):
    name: str = ""
    ts: typing.Any = None  # read for one event only: a bad one elsewhere must not fail the trace
    args: Args | None = None


class MetaEvent(msgspec.Struct, tag_field="ph", tag="M", gc=False):
    name: str = ""
    pid: int | str = 0
    args: Args | None = None


_SKIPPED = tuple(
    msgspec.defstruct(f"Skipped_{ord(ph)}", [], tag_field="ph", tag=ph, gc=False)
    for ph in ("s", "f", "t", "C", "b", "e", "n", "I", "B", "E", "P", "O", "N", "D", "R")
)
Tagged = typing.Union[(XEvent, InstantEvent, MetaEvent, *_SKIPPED)]  # noqa: UP007


class DistributedInfo(msgspec.Struct):
    rank: int | str | None = None
    world_size: int | None = None
    backend: str | None = None


class Meta(msgspec.Struct):
    schemaVersion: int | None = None
    distributedInfo: DistributedInfo | None = None
    deviceProperties: list[msgspec.Raw] | None = None
    baseTimeNanoseconds: int | None = None
    traceName: str | None = None


class DeviceProperty(msgspec.Struct):
    name: str | None = None


_device_decoder = msgspec.json.Decoder(DeviceProperty)


class Whole(Meta):
    traceEvents: list[Event] = msgspec.field(default_factory=list)


class WholeTagged(Meta):
    traceEvents: list[Tagged] = msgspec.field(default_factory=list)  # type: ignore[valid-type]


_BOUNDARY = re.compile(rb"\}\s*,\s*\{")
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
_piece_decoder = msgspec.json.Decoder(list[Event])
_whole_decoder = msgspec.json.Decoder(Whole)
_fast_piece_decoder = msgspec.json.Decoder(list[Tagged])  # type: ignore[valid-type]
_fast_whole_decoder = msgspec.json.Decoder(WholeTagged)


def _decode(fast: msgspec.json.Decoder, plain: msgspec.json.Decoder, data):  # type: ignore[no-untyped-def]
    """Decode with the tagged union; if some event has another "ph", with ``Event``."""
    try:
        return fast.decode(data)
    except msgspec.ValidationError:
        return plain.decode(data)
_meta_decoder = msgspec.json.Decoder(Meta)


def _open(path: Path, owner_ok: Callable[[int], bool] | None) -> typing.BinaryIO:
    """The file, read-only, if it is a regular file (no symlink followed, no FIFO waited on)
    owned by someone ``owner_ok`` accepts. With ``owner_ok`` (the agent reading a shared
    folder) no folder on the path may be a symlink either; a path given on the command line
    may go through one."""
    try:
        return os.fdopen(open_regular(str(path), owner_ok, exact=owner_ok is not None), "rb")
    except UnsafePath as exc:
        raise TraceError(str(exc), exc.reason) from None


def _capped(chunks: Iterator[bytes], max_bytes: int | None, max_inflated: int | None = None) -> Iterator[bytes]:
    """Stop with ``too_large`` once the *inflated* text exceeds ``max_bytes`` or
    ``max_inflated`` (a gzip bomb costs at most that much reading, never that much memory)."""
    total = 0
    try:
        for data in chunks:
            total += len(data)
            if max_bytes is not None and total > max_bytes:
                raise TraceError(f"more than traces.max_file_bytes ({max_bytes}) once uncompressed", "too_large")
            if max_inflated is not None and total > max_inflated:
                raise TraceError(f"more than traces.max_inflated_bytes ({max_inflated}) once uncompressed", "too_large")
            yield data
    finally:
        chunks.close()  # type: ignore[attr-defined]


def _chunks(path: Path, owner_ok: Callable[[int], bool] | None = None) -> Iterator[bytes]:
    """Uncompressed text in chunks of about CHUNK bytes (gzip detected by its magic)."""
    with _open(path, owner_ok) as fh:
        first = fh.read(RAW_CHUNK)
        if first[:2] != b"\x1f\x8b":
            data = first
            while data:
                yield data
                data = fh.read(CHUNK)
            return
        d = zlib.decompressobj(31)
        raw = first
        while True:
            try:
                while raw:  # at most CHUNK of text at a time, whatever the ratio
                    out = d.decompress(raw, CHUNK)
                    raw = d.unconsumed_tail
                    if d.eof and d.unused_data:  # concatenated gzip members
                        raw = d.unused_data
                        d = zlib.decompressobj(31)
                    if out:
                        yield out
            except zlib.error as exc:
                raise TraceError(f"corrupt gzip data ({exc})", "corrupt") from None
            raw = fh.read(RAW_CHUNK)
            if not raw:
                break
        if not d.eof:
            raise TraceError("the gzip stream ends early (file still being written?)", "truncated")


def _int_column(values: list, default: int = -1) -> np.ndarray:
    """int64 column; strings ("0x1f", "7") are parsed, anything unusable becomes ``default``."""
    try:
        return np.array(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        out = []
        for v in values:
            if isinstance(v, str):
                try:
                    v = int(v, 0)
                except ValueError:
                    v = default
            out.append(v if isinstance(v, int) and -(2**63) <= v < 2**63 else default)
        return np.array(out, dtype=np.int64)


MTIA_DEVICE = "mtia_ccp_events"
BAD_NAMES_KEPT = 3  # names of events left out for their duration, quoted in the warning


def _mark_dma(kind: np.ndarray, cat: list[str], name: list[str], args: list) -> None:  # type: ignore[type-arg]
    """MTIA writes kernels and DMA transfers in one category: a ``dma_*`` event, or one
    with ``args.direction`` (HOST_TO_DEVICE, DEVICE_TO_HOST), is a memory transfer."""
    for i, c in enumerate(cat):
        if c == MTIA_DEVICE:
            a = args[i]
            if name[i].startswith("dma") or (a is not None and a.direction is not None):
                kind[i] = CATEGORY_CODES["gpu_memcpy"]


_THREAD_BASE = 1 << 31  # thread code = provisional pid id * base + provisional tid id


def _dense(ids: np.ndarray, first_seen: dict) -> tuple[np.ndarray, list]:  # type: ignore[type-arg]
    """Provisional ids (position of first occurrence) -> 0..n-1, with the values in order."""
    keys = list(first_seen)
    provisional = np.fromiter(first_seen.values(), dtype=np.int64, count=len(keys))
    order = np.argsort(provisional)
    dense = np.searchsorted(provisional[order], ids).astype(np.int32)
    return dense, [keys[i] for i in order]


class _Builder:
    """Turns decoded pieces into columns, keeping only what the analyzers use."""

    def __init__(self, trace: Trace, limits: Limits = NO_LIMITS) -> None:
        self.trace = trace
        self._limits = limits
        self._events = 0  # decoded, of any kind (each costs CPU; instants and metadata memory too)
        self._names: dict[str, int] = {}
        self._pids: dict[int | str, int] = {}
        self._tids: dict[int | str, int] = {}
        self._pieces: list[tuple[np.ndarray, ...]] = []
        self._seen = 0

    def add(self, events: list) -> None:  # type: ignore[type-arg]
        """Keep what the analyzers use from decoded ``Event`` or tagged events."""
        kinds = CATEGORY_CODES
        self._events += len(events)
        limit = self._limits.max_events
        if limit is not None and self._events > limit:
            raise TraceError(f"more than traces.max_events ({limit}) events", "too_many_events")
        if events and type(events[0]).__name__ != "Event":
            kept = [e for e in events if type(e) is XEvent and e.cat in kinds]
            instant, meta = InstantEvent, MetaEvent
            if len(kept) != len(events):
                for e in events:
                    t = type(e)
                    if t is instant:
                        self._instant(e)
                    elif t is meta:
                        self._metadata(e)
        else:
            kept = [e for e in events if e.ph == "X" and e.cat in kinds]
            if len(kept) != len(events):
                for e in events:
                    if e.ph == "i":
                        self._instant(e)
                    elif e.ph == "M":
                        self._metadata(e)
        if not kept:
            return
        # None (missing or null dur) becomes NaN: left out with negative ones and those
        # whose end is not finite (JSON has no infinity: msgspec refuses 1e999 and NaN)
        start = np.array([e.ts for e in kept], dtype=np.float64)
        dur_all = np.array([e.dur for e in kept], dtype=np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            good = (dur_all >= 0) & np.isfinite(start + dur_all)
        if not good.all():
            self._count_bad(kept, dur_all, good)
            kept = [e for e, ok in zip(kept, good.tolist(), strict=True) if ok]
            start, dur_all = start[good], dur_all[good]
            if not kept:
                return
        n = len(kept)
        cat = [e.cat for e in kept]
        self.trace.categories.update(cat)
        name = [e.name for e in kept]
        pid = [e.pid for e in kept]
        tid = [e.tid for e in kept]
        cut = self._limits.max_name_chars
        if cut is not None:
            name, pid, tid = _cut(name, cut), _cut(pid, cut), _cut(tid, cut)
        args = [e.args for e in kept]
        # provisional ids: the position of a name's first occurrence (made dense in finish)
        ids = range(self._seen, self._seen + n)
        self._seen += n
        kind = np.fromiter(map(kinds.__getitem__, cat), dtype=np.int8, count=n)
        if MTIA_DEVICE in cat:
            _mark_dma(kind, cat, name, args)
        self._pieces.append((
            start,
            start + dur_all,
            kind,
            np.fromiter(map(self._names.setdefault, name, ids), dtype=np.int64, count=n),
            np.fromiter(map(self._pids.setdefault, pid, ids), dtype=np.int64, count=n) * _THREAD_BASE
            + np.fromiter(map(self._tids.setdefault, tid, ids), dtype=np.int64, count=n),
            # (an explicit null makes _int_column take its slow path, which maps it to -1)
            _int_column([-1 if a is None else a.correlation for a in args]),
            _int_column([-1 if a is None else a.device for a in args]),
        ))
        most = self._limits.max_names
        if most is not None and max(len(self._names), len(self._pids) + len(self._tids)) > most:
            raise TraceError(f"more than traces.max_names ({most}) distinct event names or threads", "too_many_names")

    def _count_bad(self, kept: list, dur: np.ndarray, good: np.ndarray) -> None:  # type: ignore[type-arg]
        """Count the events left out for their duration, by cause, and keep a few names."""
        bad = self.trace.bad_durations
        for i in np.flatnonzero(~good).tolist():
            d = dur[i]
            cause = "missing" if np.isnan(d) else ("negative" if d < 0 else "non_finite")
            bad[cause] = bad.get(cause, 0) + 1
            examples = self.trace.bad_duration_names
            if len(examples) < BAD_NAMES_KEPT and kept[i].name[:120] not in examples:
                examples.append(kept[i].name[:120])

    def _instant(self, e: Event | InstantEvent) -> None:
        a = e.args
        if e.name == "[memory]" and a is not None and a.total_allocated is not None:
            self.trace.memory.append((a.device_type, a.device_id, a.total_allocated))
        elif e.name == WINDOW_END and self.trace.window_end is None and _is_time(e.ts):
            self.trace.window_end = float(e.ts)  # libkineto writes one; a second is not believed over the first

    def _metadata(self, e: Event | MetaEvent) -> None:
        if e.name != "process_labels" or e.args is None or not isinstance(e.pid, int):
            return
        label = e.args.labels or ""
        if label == "CPU":
            self.trace.cpu_pids.add(e.pid)
        elif label.startswith("GPU "):
            try:
                self.trace.gpu_devices[e.pid] = int(label.split()[1])
            except (IndexError, ValueError):
                pass

    def finish(self) -> None:
        t = self.trace
        if self._pieces:
            cols = [np.concatenate(c) for c in zip(*self._pieces, strict=True)]
            t.ts, t.end, t.kind, t.name, t.thread, t.corr, t.device = cols
        self._pieces.clear()
        t.name, t.names = _dense(t.name, self._names)
        codes, t.thread = np.unique(t.thread, return_inverse=True)
        t.thread = t.thread.astype(np.int32)
        pids = {v: k for k, v in self._pids.items()}
        tids = {v: k for k, v in self._tids.items()}
        t.threads = [(pids[c // _THREAD_BASE], tids[c % _THREAD_BASE]) for c in codes.tolist()]
        gpu_missing = (t.kind <= CATEGORY_CODES["gpu_memset"]) & (t.device < 0)
        if gpu_missing.any():  # no args.device: the GPU's pid ("GPU N" label), else the pid
            per_thread = np.array([t.gpu_devices.get(p, p) if isinstance(p, int) else 0 for p, _ in t.threads],
                                  dtype=np.int64)
            t.device[gpu_missing] = per_thread[t.thread[gpu_missing]]


def _cut(values: list, most: int) -> list:  # type: ignore[type-arg]
    """``values`` with each string longer than ``most`` cut there, "…" added (one pass to
    look: almost always nothing to cut)."""
    if not any(type(v) is str and len(v) > most for v in values):
        return values
    return [v[:most] + "…" if type(v) is str and len(v) > most else v for v in values]


def _is_time(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _meta_into(trace: Trace, meta: Meta) -> None:
    info = meta.distributedInfo
    if info is not None and info.rank is not None:
        trace.rank = bound(str(info.rank))  # a label: bounded like the environment's
        trace.world_size = info.world_size
        trace.backend = info.backend[:40] if info.backend else None
    if meta.baseTimeNanoseconds is not None:
        trace.base_time_ns = meta.baseTimeNanoseconds
    if meta.deviceProperties is not None:
        trace.device_count = len(meta.deviceProperties)
        for raw in meta.deviceProperties:
            try:
                name = _device_decoder.decode(raw).name
            except (msgspec.DecodeError, UnicodeDecodeError):
                continue
            if name:
                trace.device_names.append(name[:200])


def _decode_error(exc: Exception) -> TraceError:
    text = str(exc)
    if "truncated" in text:
        return TraceError("the JSON ends early (file still being written?)", "truncated")
    return TraceError(f"malformed trace JSON ({text})", "corrupt")


def read_trace(
    path: str | Path, max_bytes: int | None = None, owner_ok: Callable[[int], bool] | None = None,
    max_buffered: int = MAX_BUFFERED, limits: Limits = NO_LIMITS, max_inflated: int | None = None,
) -> Trace:
    """Parse a Kineto trace (.json or .json.gz, detected by content).

    Raises TraceError: ``truncated`` (incomplete gzip or JSON), ``corrupt`` (bad gzip or
    JSON), ``not_a_trace`` (no traceEvents array), ``unreadable`` (OS error), and, for
    files the agent refuses to read: ``symlink``, ``not_regular``, ``foreign_owner``
    (``owner_ok`` said no), ``too_large`` (over ``max_bytes`` uncompressed),
    ``too_large_event`` (more than ``max_buffered`` bytes of text held at once),
    ``too_many_events``, ``too_many_names`` (over ``limits``) and ``too_large`` again for
    more than ``max_inflated`` bytes once uncompressed (``traces.max_inflated_bytes``).
    """
    path = Path(path)
    trace = Trace(str(path))
    builder = _Builder(trace, limits)
    chunks = _capped(_chunks(path, owner_ok), max_bytes, max_inflated)
    try:
        _stream_into(chunks, trace, builder, max_buffered)
    except OSError as exc:
        raise TraceError(f"cannot read {path} ({exc.strerror or exc})", "unreadable") from None
    except RecursionError:  # msgspec's nesting guard: "[[[[..." a million deep
        raise TraceError("malformed trace JSON (nested too deeply)", "corrupt") from None
    finally:
        chunks.close()  # closes the file at once, also on errors
    builder.finish()
    return trace


def _over(max_buffered: int) -> TraceError:
    return TraceError(f"more than traces.max_buffered_bytes ({max_buffered}) of text without an event "
                      "boundary (one huge event, string or run of blanks)", "too_large_event")


def _stream_into(chunks: Iterator[bytes], trace: Trace, builder: _Builder, max_buffered: int = MAX_BUFFERED) -> None:
    buf = bytearray()
    # 1. the metadata before the events array
    match = None
    for data in chunks:
        trace.bytes_read += len(data)
        buf += data
        match = _EVENTS_KEY.search(buf)
        if match:
            break
        if len(buf) > max_buffered:
            raise _over(max_buffered)
    if match is None:
        _not_events(bytes(buf))
        return
    head = bytes(buf[: match.start()])
    if head.strip() == b"{" or head.rstrip().endswith(b","):
        try:
            _meta_into(trace, _meta_decoder.decode(head + b'"traceEvents": []}'))
        except (msgspec.DecodeError, UnicodeDecodeError):
            pass  # odd metadata is not fatal; the tail or events may still be fine
    # 2. complete events, piece by piece. ``pending`` always starts with "[" and then the
    # text of the next undecoded event.
    pending = bytearray(b"[")
    pending += memoryview(buf)[match.end():]
    del buf, head
    due = CHUNK  # drain when pending is this long
    for data in chunks:
        trace.bytes_read += len(data)
        pending += data
        if len(pending) >= due or len(pending) > max_buffered:
            _drain(pending, builder)
            if len(pending) > max_buffered:
                raise _over(max_buffered)
            # nothing decodable yet (a huge event): wait for twice as much text before
            # trying again, so a long event is not re-parsed once per small chunk
            due = CHUNK if len(pending) < CHUNK else 2 * len(pending)
    if len(pending) > max_buffered:
        raise _over(max_buffered)
    # 3. the last events and the metadata after the array
    try:
        whole = _decode(_fast_whole_decoder, _whole_decoder, b'{"traceEvents": ' + pending)
    except msgspec.ValidationError as exc:
        raise TraceError(f"unexpected trace content ({exc})", "corrupt") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise _decode_error(exc) from None
    builder.add(whole.traceEvents)
    _meta_into(trace, whole)


def _not_events(buf: bytes) -> None:
    """No traceEvents key: say whether the text is incomplete, broken, or another JSON."""
    if not buf.strip():
        raise TraceError("the file is empty (still being written?)", "truncated")
    try:  # checked as Raw: validated without building its objects (64 MB of "[{},{}...]" was 2 GB of dicts)
        msgspec.json.decode(buf, type=msgspec.Raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise _decode_error(exc) from None
    raise TraceError("no traceEvents array: not a torch profiler trace", "not_a_trace")


def _drain(pending: bytearray, builder: _Builder) -> None:
    """Decode the complete events at the front of ``pending`` ("[" + events) in place."""
    end = len(pending)
    for _ in range(8):  # a candidate inside a string or nested object fails to decode
        cut = _last_boundary(pending, end)
        if cut is None:
            break
        saved = pending[cut + 1]
        pending[cut + 1] = 0x5D  # "]" over the "," or blank after the event's "}"
        try:
            with memoryview(pending) as view:
                events = _decode(_fast_piece_decoder, _piece_decoder, view[: cut + 2])
        except (msgspec.DecodeError, UnicodeDecodeError):
            pending[cut + 1] = saved
            end = cut
            continue
        builder.add(events)
        nxt = pending.index(b"{", cut + 1)
        pending[nxt - 1] = 0x5B  # "["
        del pending[: nxt - 1]
        return


def _last_boundary(buf: bytes | bytearray, end: int) -> int | None:
    """Position of the '}' of the last '},{' before ``end`` (searched backwards)."""
    pos = end
    while True:
        pos = buf.rfind(b"}", 0, pos)
        if pos < 0:
            return None
        m = _BOUNDARY.match(buf, pos)
        if m is not None and m.end() <= end:
            return pos

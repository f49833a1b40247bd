"""perf_event_open(2) for tracepoint events, read from per-CPU ring buffers.

No library exposes perf_event_open to Python, so this module is the one place that
calls it (ctypes). It opens a tracefs event (a uprobe, say) once per CPU, system-wide
(``pid=-1``), never with ``inherit``: a uprobe-PMU event with inherit makes the target's
``fork()`` fail, and a per-CPU event needs no per-thread fd. Each CPU gets one ring,
owned by a dummy software event; every tracepoint there writes into it
(PERF_EVENT_IOC_SET_OUTPUT), so one event can be closed alone. The kernel arms a probe only while such an fd
is open, so an agent that dies (SIGKILL included) leaves nothing armed in the targets.

Samples carry the pid and tid as seen from the opener's PID namespace (0 when not
visible), CLOCK_MONOTONIC nanoseconds, and the event's raw record.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import operator
import os
import platform
import select
import struct
import threading
from collections.abc import Callable

import numpy

_NR_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}.get(platform.machine())

PERF_TYPE_SOFTWARE = 1
PERF_TYPE_TRACEPOINT = 2
PERF_COUNT_SW_DUMMY = 9
PERF_SAMPLE_TID = 1 << 1
PERF_SAMPLE_TIME = 1 << 2
PERF_SAMPLE_RAW = 1 << 10
PERF_RECORD_LOST = 2
PERF_RECORD_SAMPLE = 9
PERF_FLAG_FD_CLOEXEC = 1 << 3
PERF_EVENT_IOC_ENABLE = 0x2400
PERF_EVENT_IOC_SET_OUTPUT = 0x2405
CLOCK_MONOTONIC = 1

_ATTR_SIZE = 136  # PERF_ATTR_SIZE_VER8
_FLAG_WATERMARK = 1 << 14
_FLAG_USE_CLOCKID = 1 << 25
# A sample as we ask for it: header (type, misc, size), pid, tid, time, raw size, then the raw record,
# whose first field is the event's type (its tracepoint id). One unpack a sample.
_SAMPLE = struct.Struct("<IHHIIQIH")
_RAW_AT = 28  # the raw record's offset in a sample
_TIME = operator.itemgetter(0)
_PAD = bytes(_SAMPLE.size)  # after the last record, so that a short one unpacks too
_HEADER = struct.Struct("<IHH")  # perf_event_header: type, misc, size
_dtypes: dict[int, numpy.dtype] = {}  # sample size -> the array type of a ring of such samples
LOSSES_KEPT = 4096  # losses waiting for the caller to attribute them (it takes them every read)
# A ring holding less than this is read a record at a time: numpy's fixed cost is more
# than the records' below about fifty samples.
ARRAY_BYTES = 4096
_META = struct.Struct("<QQ")  # data_head, data_tail at offset 1024 of the first page

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.ioctl.restype = ctypes.c_int


def available() -> str:
    """"" when perf_event_open can be called on this machine, else why not."""
    if _NR_PERF_EVENT_OPEN is None:
        return f"perf_event_open is not wired for {platform.machine()}"
    return ""


def _attr(kind: int, config: int, wakeup_bytes: int) -> ctypes.Array[ctypes.c_char]:
    buf = ctypes.create_string_buffer(_ATTR_SIZE)
    struct.pack_into("<IIQQQQQI", buf, 0, kind, _ATTR_SIZE, config,
                     1,  # sample_period: every hit
                     PERF_SAMPLE_TID | PERF_SAMPLE_TIME | PERF_SAMPLE_RAW, 0,
                     _FLAG_WATERMARK | _FLAG_USE_CLOCKID,  # enabled at open, inherit off
                     wakeup_bytes)
    struct.pack_into("<i", buf, 92, CLOCK_MONOTONIC)
    return buf


def _open(tracepoint_id: int, cpu: int, wakeup_bytes: int, kind: int = PERF_TYPE_TRACEPOINT) -> int:
    """An event on ``cpu`` for every process: a tracepoint, or with ``kind``
    PERF_TYPE_SOFTWARE the dummy event that owns the CPU's ring (it never fires)."""
    attr = _attr(kind, tracepoint_id if kind == PERF_TYPE_TRACEPOINT else PERF_COUNT_SW_DUMMY, wakeup_bytes)
    fd = _libc.syscall(_NR_PERF_EVENT_OPEN, attr, -1, cpu, -1, PERF_FLAG_FD_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"perf_event_open(tracepoint {tracepoint_id}, cpu {cpu}): {os.strerror(err)}")
    return int(fd)


# One probe hit: (CLOCK_MONOTONIC ns, pid, tid, tracepoint id, raw record). A plain tuple,
# not a NamedTuple: tens of thousands a second are made, and a tuple costs a thirtieth.
# The pid and tid are as seen from the opener's PID namespace (0 when not visible there);
# the raw record holds the common fields, then the event's own fields.
Sample = tuple[int, int, int, int, bytes]


class _Ring:
    """One CPU's ring buffer: 1 + 2^n pages, the first holding head and tail."""

    def __init__(self, fd: int, pages: int) -> None:
        self.fd = fd
        self.page = mmap.PAGESIZE
        self.size = pages * self.page
        self.map = mmap.mmap(fd, self.page + self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def drain(self, lost: list[int], out: list[Sample], counts: dict[int, int] | None = None,
              drop: frozenset[int] = frozenset()) -> None:
        """Append the ring's samples to ``out`` and hand their space back to the kernel.

        What arrived is copied out in one piece (the unwrapped bytes from tail to head):
        reading each sample in place from the mapping costs five times more. Samples all
        of one size are then read as one array, others one record at a time."""
        head, tail = _META.unpack_from(self.map, 1024)
        if tail >= head:
            return
        end = min(head - tail, self.size)
        chunk = _wrapped(self.map, self.page, self.size, tail % self.size, end) + _PAD
        if end < ARRAY_BYTES or not _uniform(chunk, end, out, counts, drop):
            _walk(chunk, end, lost, out, counts, drop)
        struct.pack_into("<Q", self.map, 1032, head)  # data_tail: the kernel may reuse it all

    def close(self) -> None:
        self.map.close()


def _uniform(chunk: bytes, end: int, out: list[Sample], counts: dict[int, int] | None = None,
             drop: frozenset[int] = frozenset()) -> bool:
    """Read ``chunk`` as one array when it holds samples of one size only (the events'
    records are all that size, and nothing was lost): True when it did. Samples are
    counted by pid into ``counts``; those of ``drop``'s pids are left out as an array,
    at a fortieth of the cost of reading them one by one."""
    kind, _, size = _HEADER.unpack_from(chunk, 0)
    if kind != PERF_RECORD_SAMPLE or size < _SAMPLE.size or end % size:
        return False
    dtype = _dtypes.get(size)
    if dtype is None:
        dtype = _dtypes[size] = numpy.dtype({
            "names": ["kind", "size", "pid", "tid", "time", "raw_size", "event", "raw"],
            "formats": ["<u4", "<u2", "<u4", "<u4", "<u8", "<u4", "<u2", f"V{size - _RAW_AT}"],
            "offsets": [0, 6, 8, 12, 16, 24, _RAW_AT, _RAW_AT], "itemsize": size})
    records = numpy.frombuffer(chunk, dtype=dtype, count=end // size)
    if not ((records["kind"] == PERF_RECORD_SAMPLE).all() and (records["size"] == size).all()
            and (records["raw_size"] == size - _RAW_AT).all()):
        return False
    if counts is not None:
        pids, n = numpy.unique(records["pid"], return_counts=True)
        for pid, k in zip(pids.tolist(), n.tolist(), strict=True):
            counts[pid] = counts.get(pid, 0) + k
    if drop:
        records = records[~numpy.isin(records["pid"], numpy.fromiter(drop, dtype="<u4", count=len(drop)))]
    out.extend(zip(records["time"].tolist(), records["pid"].tolist(), records["tid"].tolist(),
                   records["event"].tolist(), records["raw"].tolist(), strict=True))
    return True


def _walk(chunk: bytes, end: int, lost: list[int], out: list[Sample], counts: dict[int, int] | None = None,
          drop: frozenset[int] = frozenset()) -> None:
    """Read ``chunk`` one record at a time (records of several sizes, or lost records)."""
    unpack, append, at = _SAMPLE.unpack_from, out.append, 0
    sample, smallest = PERF_RECORD_SAMPLE, _SAMPLE.size
    while at < end:
        kind, _, length, pid, tid, time_ns, raw_size, event = unpack(chunk, at)
        if length < 8:  # never from a sane kernel: drop the rest rather than spin
            break
        if kind == sample and length >= smallest:
            if counts is not None:
                counts[pid] = counts.get(pid, 0) + 1
            if pid not in drop:
                raw = at + _RAW_AT
                append((time_ns, pid, tid, event, chunk[raw:raw + min(raw_size, length - _RAW_AT)]))
        elif kind == PERF_RECORD_LOST and length >= 24:
            lost[0] += struct.unpack_from("<Q", chunk, at + 16)[0]
        at += length


def _wrapped(data: mmap.mmap, base: int, size: int, start: int, length: int) -> bytes:
    end = start + length
    if end <= size:
        return data[base + start:base + end]
    return data[base + start:base + size] + data[base:base + end - size]


class TracepointReader:
    """Tracepoint events opened on every online CPU, read from one ring per CPU.

    ``add`` and ``remove`` may be called at any time (a library to probe, one no longer
    mapped); ``wait`` returns once a ring is a quarter full, ``wake`` is called or the
    timeout passes, ``drain`` takes what arrived (``read``: both). Closing a uprobe's last
    fd disarms it, which the kernel makes slow (``remove``, ``close``).
    """

    def __init__(self, pages: int = 64, cpus: list[int] | None = None) -> None:
        self.cpus = cpus if cpus is not None else sorted(_online_cpus() or range(os.cpu_count() or 1))
        self.pages = pages
        self.rings: dict[int, _Ring] = {}  # cpu -> its ring, on a dummy event's fd
        self.fds: dict[int, list[int]] = {}  # tracepoint id -> its fds, one per CPU
        self.lost = [0]
        # (events lost, pids whose samples that ring held in the same read): a lost record
        # says neither whose events it dropped nor when, so who ran there is the best clue
        self.losses: list[tuple[int, frozenset[int]]] = []
        self.counts: dict[int, int] = {}  # pid -> samples read, until the caller resets it
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poller: tuple[tuple[int, ...], select.poll] | None = None

    def add(self, tracepoint_id: int) -> None:
        """Open ``tracepoint_id`` on every CPU. Raises OSError; on failure nothing of it stays open."""
        wakeup = self.pages * mmap.PAGESIZE // 4
        for cpu in self.cpus:
            if cpu not in self.rings:
                fd = _open(0, cpu, wakeup, kind=PERF_TYPE_SOFTWARE)
                try:
                    self.rings[cpu] = _Ring(fd, self.pages)
                except BaseException:
                    os.close(fd)
                    raise
        opened: list[int] = []
        try:
            for cpu in self.cpus:
                fd = _open(tracepoint_id, cpu, wakeup_bytes=wakeup)
                opened.append(fd)
                if _libc.ioctl(fd, PERF_EVENT_IOC_SET_OUTPUT, self.rings[cpu].fd) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"PERF_EVENT_IOC_SET_OUTPUT: {os.strerror(err)}")
        except BaseException:
            for fd in opened:
                os.close(fd)
            raise
        self.fds[tracepoint_id] = opened

    def remove(self, tracepoint_id: int) -> None:
        """Close one event's fds (its probe is disarmed once they are closed)."""
        for fd in self.fds.pop(tracepoint_id, ()):
            os.close(fd)

    def read(self, timeout: float, lock: threading.Lock | None = None, drop: frozenset[int] = frozenset()) -> list[Sample]:
        """Every sample that arrived, waiting up to ``timeout`` seconds for a ring to be a
        quarter full, but those of ``drop``'s pids (counted in ``counts`` all the same).
        ``lock`` (held by whoever calls ``add``) is held while the rings are read, not while
        waiting."""
        guard = lock if lock is not None else contextlib.nullcontext()
        self.wait(timeout, lock)
        with guard:
            return self.drain(drop)

    def wait(self, timeout: float, lock: threading.Lock | None = None) -> None:
        """Wait up to ``timeout`` seconds for a ring to be a quarter full, or ``wake``."""
        with lock if lock is not None else contextlib.nullcontext():
            fds = tuple(ring.fd for ring in self.rings.values())
        if not fds:
            return
        if self._poller is None or self._poller[0] != fds:  # the same rings from the first event on
            poller = select.poll()
            for fd in (*fds, self._wake_r):
                poller.register(fd, select.POLLIN)
            self._poller = (fds, poller)
        if any(fd == self._wake_r for fd, _ in self._poller[1].poll(max(0, int(timeout * 1000)))):
            with contextlib.suppress(OSError):
                os.read(self._wake_r, 4096)

    def wake(self) -> None:
        """End a ``wait`` now (stopping)."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def drain(self, drop: frozenset[int] = frozenset()) -> list[Sample]:
        """Every sample in the rings, oldest first, but those of ``drop``'s pids (counted in
        ``counts`` all the same); the caller holds ``add``'s lock."""
        out: list[Sample] = []
        if self.rings:
            for ring in list(self.rings.values()):
                lost, start = self.lost[0], len(out)
                ring.drain(self.lost, out, self.counts, drop)
                if self.lost[0] > lost and len(self.losses) < LOSSES_KEPT:
                    self.losses.append((self.lost[0] - lost, frozenset(sample[1] for sample in out[start:])))
            out.sort(key=_TIME)  # rings are per CPU, and a thread may move between them
        return out

    def close(self, each: Callable[[int], None] | None = None) -> None:
        """Close everything: every event's fds first, then the rings; ``each(tracepoint_id)``
        is called for every event once all are closed (its definition can go then)."""
        fds, self.fds = self.fds, {}
        for group in fds.values():
            for fd in group:
                os.close(fd)
        for ring in self.rings.values():
            ring.close()
            os.close(ring.fd)
        self.rings = {}
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1
        if each is not None:
            for tracepoint_id in fds:
                each(tracepoint_id)


def _online_cpus() -> set[int]:
    try:
        with open("/sys/devices/system/cpu/online") as fh:
            text = fh.read().strip()
    except OSError:
        return set()
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit():
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus

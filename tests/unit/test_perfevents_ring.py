"""Reading perf's ring buffer: the records the kernel writes, laid out as it lays them out
(header page with head and tail at 1024, then 2^n data pages), in an anonymous mapping."""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time

import pytest

from profagent.system import perfevents

PAGE = mmap.PAGESIZE
PAGES = 2


def sample(time_ns: int, pid: int, tid: int, event: int, fields: bytes) -> bytes:
    raw = struct.pack("<HBBi", event, 0, 0, pid) + fields
    raw += bytes(-(len(raw) + 4) % 8)  # the kernel pads the raw record so samples stay 8-aligned
    body = struct.pack("<IIQI", pid, tid, time_ns, len(raw)) + raw
    return struct.pack("<IHH", perfevents.PERF_RECORD_SAMPLE, 0, 8 + len(body)) + body


def lost(count: int) -> bytes:
    return struct.pack("<IHHQQ", perfevents.PERF_RECORD_LOST, 0, 24, 1, count)


def ring_with(records: list[bytes], start: int) -> tuple[perfevents._Ring, int]:
    """A ring whose unread records begin ``start`` bytes into its data (wrapping at the end)."""
    ring = perfevents._Ring.__new__(perfevents._Ring)
    ring.fd, ring.page, ring.size = -1, PAGE, PAGES * PAGE
    ring.map = mmap.mmap(-1, PAGE + ring.size)
    data = b"".join(records)
    for i, byte in enumerate(data):
        ring.map[PAGE + (start + i) % ring.size] = byte
    head = start + len(data)
    struct.pack_into("<QQ", ring.map, 1024, head, start)
    return ring, head


@pytest.mark.parametrize("missed", [5, 0], ids=["one-at-a-time", "as-one-array"])
def test_samples_across_the_wrap_and_lost_records_are_read_and_the_tail_handed_back(missed: int) -> None:
    """Samples of one size are read as an array; a lost record among them (24 bytes) makes
    the ring be read one record at a time. Both ways give the same samples."""
    name = b"Optimizer.step#SGD.step"[:16]
    records = [sample(1_000 + i, 40 + i % 2, 50, 7 + i % 3, struct.pack("<Q", 0xABC) + name) for i in range(100)]
    assert len(b"".join(records)) >= perfevents.ARRAY_BYTES  # enough to be read as an array
    if missed:
        records.insert(20, lost(missed))
    start = PAGES * PAGE - 3 * len(records[0]) - 4  # a record straddles the end of the data pages
    ring, head = ring_with(records, start)
    out: list[perfevents.Sample] = []
    count = [0]
    ring.drain(count, out)
    assert [(t, pid, tid, event) for t, pid, tid, event, _ in out] == [
        (1_000 + i, 40 + i % 2, 50, 7 + i % 3) for i in range(100)]
    assert all(raw[16:32] == name for *_, raw in out)
    assert count == [missed]
    assert struct.unpack_from("<Q", ring.map, 1032)[0] == head  # the kernel may write there again
    again: list[perfevents.Sample] = []
    ring.drain(count, again)
    assert again == []


def test_a_record_too_short_to_be_sane_drops_the_rest_and_frees_the_ring() -> None:
    good = sample(5, 1, 1, 9, b"")
    broken = struct.pack("<IHH", perfevents.PERF_RECORD_SAMPLE, 0, 4)  # a size below its own header
    ring, head = ring_with([good, broken, good], 0)
    out: list[perfevents.Sample] = []
    ring.drain([0], out)
    assert [t for t, *_ in out] == [5]
    assert struct.unpack_from("<Q", ring.map, 1032)[0] == head


def test_reading_as_one_array_and_one_at_a_time_agree() -> None:
    records = b"".join(sample(7 * i, 3, 4 + i, 11, struct.pack("<QQ", i, ~i & 0xFFFF)) for i in range(300))
    chunk, one_array, walked = records + perfevents._PAD, [], []
    assert perfevents._uniform(chunk, len(records), one_array)
    perfevents._walk(chunk, len(records), [0], walked)
    assert one_array == walked
    assert len(walked) == 300


def test_a_shed_pids_samples_are_counted_and_left_out_either_way() -> None:
    records = b"".join(sample(7 * i, 3 if i % 3 else 9, 4 + i, 11, struct.pack("<QQ", i, i)) for i in range(300))
    chunk = records + perfevents._PAD
    one_array: list[perfevents.Sample] = []
    walked: list[perfevents.Sample] = []
    array_counts: dict[int, int] = {}
    walk_counts: dict[int, int] = {}
    assert perfevents._uniform(chunk, len(records), one_array, array_counts, frozenset({9}))
    perfevents._walk(chunk, len(records), [0], walked, walk_counts, frozenset({9}))
    assert one_array == walked
    assert {pid for _, pid, *_ in walked} == {3} and len(walked) == 200
    assert array_counts == walk_counts == {3: 200, 9: 100}


def test_a_ring_holding_a_few_samples_is_read_one_record_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below ARRAY_BYTES numpy's fixed cost is more than the records': not called there."""
    records = [sample(10 + i, 5, 6, 8, struct.pack("<Q", i)) for i in range(4)]
    ring, head = ring_with(records, 0)
    monkeypatch.setattr(perfevents, "_uniform", lambda *a: pytest.fail("read as an array"))
    out: list[perfevents.Sample] = []
    ring.drain([0], out)
    assert [(t, pid, tid, event) for t, pid, tid, event, _ in out] == [(10 + i, 5, 6, 8) for i in range(4)]
    assert struct.unpack_from("<Q", ring.map, 1032)[0] == head


def test_a_wait_for_events_ends_when_woken() -> None:
    """The reader waits a second between wake-ups; a stop must not wait that long."""
    reader = perfevents.TracepointReader(pages=1, cpus=[0])
    quiet, writer = os.pipe()  # a ring fd on which nothing arrives
    ring = perfevents._Ring.__new__(perfevents._Ring)
    ring.fd = quiet
    reader.rings[0] = ring
    try:
        began = time.monotonic()
        reader.wait(0.05)
        assert time.monotonic() - began >= 0.04  # it did wait: nothing arrived
        threading.Timer(0.1, reader.wake).start()
        began = time.monotonic()
        reader.wait(30.0)
        assert time.monotonic() - began < 10.0
        began = time.monotonic()
        reader.wait(0.05)  # the wake-up was taken: the next wait waits again
        assert time.monotonic() - began >= 0.04
    finally:
        reader.rings.clear()
        os.close(quiet)
        os.close(writer)
        reader.close()


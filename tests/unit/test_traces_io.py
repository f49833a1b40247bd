"""Reading Kineto traces: chunked decoding, odd inputs, clear errors."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.paths import shared_traces
from profagent.analysis.trace.report import analyze
from profagent.sources.traces import reader as traceio
from profagent.sources.traces.reader import TraceError, read_trace

SMALL = shared_traces() / "mi250-rocm.pt.trace.json.gz"
V100 = shared_traces() / "v100-rank0.pt.trace.json.gz"


def _events(trace: traceio.Trace) -> list[tuple]:
    names = [trace.names[i] for i in trace.name]
    threads = [trace.threads[i] for i in trace.thread]
    return list(zip(trace.kind.tolist(), names, trace.ts.tolist(), trace.end.tolist(), threads,
                    trace.corr.tolist(), trace.device.tolist(), strict=True))


def _write(path: Path, data: dict | str | bytes) -> Path:
    if isinstance(data, dict):
        data = json.dumps(data)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def test_chunked_decoding_equals_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    whole = read_trace(V100)
    monkeypatch.setattr(traceio, "CHUNK", 64 * 1024)  # hundreds of pieces
    pieces = read_trace(V100)
    assert _events(pieces) == _events(whole)
    assert pieces.bytes_read == whole.bytes_read
    assert (pieces.rank, pieces.device_count, pieces.base_time_ns) == (whole.rank, whole.device_count, whole.base_time_ns)


def test_float_nanosecond_timestamps_are_kept() -> None:
    trace = read_trace(V100)
    assert (trace.ts != trace.ts.astype(int)).any()


def test_kept_events_match_a_plain_json_count() -> None:
    with gzip.open(V100, "rt") as fh:
        raw = json.load(fh)["traceEvents"]
    expected = sum(1 for e in raw if e.get("ph") == "X" and e.get("cat") in traceio.CATEGORY_CODES)
    assert len(read_trace(V100)) == expected


def test_huge_integers_in_args_and_minified_json(tmp_path: Path) -> None:
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10, "dur": 5,
         "args": {"Addr": 2**80, "External id": 2**70}},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 12, "dur": 3,
         "args": {"correlation": 5, "device": 0, "stream": 7, "huge": -(2**90)}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 11, "dur": 1,
         "args": {"correlation": 5}},
        {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1, "ts": 11,
         "args": {"Total Allocated": 4096, "Device Type": 1, "Device Id": 0, "Addr": 2**100}},
    ]
    path = _write(tmp_path / "big.json", json.dumps({"traceEvents": events}, separators=(",", ":")))
    trace = read_trace(path)
    assert [trace.names[i] for i in trace.name] == ["aten::mm", "k", "cudaLaunchKernel"]
    assert trace.corr.tolist() == [-1, 5, 5] and trace.device.tolist() == [-1, 0, -1]
    report = analyze(trace)
    assert report.memory_peak == {"cuda:0": 4096}
    assert report.launch_delay["max"] == pytest.approx(1e-6)
    assert report.rank is None and report.steps_inferred


@pytest.mark.parametrize("ts", ["12", None, True, [12], {"t": 12}, 2**80])
def test_an_instant_event_with_an_odd_time_neither_fails_the_trace_nor_ends_its_window(tmp_path: Path, ts) -> None:
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10, "dur": 5},
        {"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": ts},
        {"ph": "i", "s": "t", "name": "[memory]", "pid": 1, "tid": 1, "ts": ts, "args": {"Total Allocated": 1}},
    ]
    trace = read_trace(_write(tmp_path / "odd.json", json.dumps({"traceEvents": events})))
    assert len(trace) == 1 and len(trace.memory) == 1
    assert trace.window_end == (float(ts) if ts == 2**80 else None)


def test_base_time_and_missing_metadata(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.json", {"baseTimeNanoseconds": 1700000000000000000,
                                        "traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 1.5, "dur": 2.25, "pid": 3, "tid": 3}]})
    trace = read_trace(path)
    assert trace.base_time_ns == 1700000000000000000
    assert trace.device_count is None and trace.rank is None


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ('{"traceEvents": [{"ph": "X", "cat": "cpu_op", "ts": 1', "truncated"),
        ('{"traceEvents": [{"ph": "X",, }]}', "corrupt"),
        ('{"schemaVersion": 1, "other": []}', "not_a_trace"),
        ("[1, 2, 3]", "not_a_trace"),
        ("", "truncated"),
        ('{"traceEvents": [{"ph": "X", "ts": "soon"}]}', "corrupt"),
    ],
)
def test_bad_json_gives_a_reason(tmp_path: Path, content: str, reason: str) -> None:
    with pytest.raises(TraceError) as err:
        read_trace(_write(tmp_path / "bad.json", content))
    assert err.value.reason == reason
    assert "\n" not in str(err.value)


def test_truncated_and_corrupt_gzip(tmp_path: Path) -> None:
    data = SMALL.read_bytes()
    with pytest.raises(TraceError) as err:
        read_trace(_write(tmp_path / "cut.json.gz", data[: len(data) // 2]))
    assert err.value.reason == "truncated"
    broken = bytearray(data)
    broken[len(broken) // 2 : len(broken) // 2 + 64] = b"\x00" * 64
    with pytest.raises(TraceError) as err:
        read_trace(_write(tmp_path / "bad.json.gz", bytes(broken)))
    assert err.value.reason in ("corrupt", "truncated")


def test_missing_file_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(TraceError) as err:
        read_trace(tmp_path / "nope.json")
    assert err.value.reason == "unreadable"


def test_empty_events_list(tmp_path: Path) -> None:
    trace = read_trace(_write(tmp_path / "e.json", {"traceEvents": []}))
    assert len(trace) == 0 and trace.memory == []
    report = analyze(trace)
    assert report.steps == () and report.gpu is None and report.step_mean is None


SMALL_TEXT = gzip.decompress(SMALL.read_bytes())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.tuples(st.integers(0, len(SMALL_TEXT) - 1), st.binary(min_size=0, max_size=4)), min_size=1, max_size=6),
    st.integers(1, len(SMALL_TEXT)),
)
def test_mutated_real_traces_never_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edits: list[tuple[int, bytes]], keep: int
) -> None:
    monkeypatch.setattr(traceio, "CHUNK", 8192)  # go through the piece-by-piece path too
    data = bytearray(SMALL_TEXT)
    for pos, repl in edits:
        data[pos : pos + len(repl) or pos + 1] = repl
    path = tmp_path / "m.json"
    path.write_bytes(bytes(data[:keep]))
    try:
        trace = read_trace(path)
    except TraceError as exc:
        assert exc.reason in ("truncated", "corrupt", "not_a_trace")
        return
    analyze(trace)  # whatever parsed must analyse without raising


def _gz_stream(path: Path, *parts: tuple[bytes, int]) -> Path:
    """A .json.gz of each (block, times) repeated, compressed as it goes (a bomb in bytes)."""
    import zlib

    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    with path.open("wb") as fh:
        for block, times in parts:
            for _ in range(times):
                fh.write(c.compress(block))
        fh.write(c.flush())
    return path


MiB = 1024 * 1024
_SPACES = b" " * MiB


@pytest.mark.parametrize("name, parts", [
    ("blanks_in_events", [(b'{"traceEvents": [', 1), (_SPACES, 12), (b"]}", 1)]),
    ("blanks_before_events", [(b"{", 1), (_SPACES, 12), (b'"traceEvents": []}', 1)]),
    ("huge_name", [(b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "', 1), (b"A" * MiB, 12),
                   (b'", "ts": 1, "dur": 2}]}', 1)]),
    ("blanks_between_events", [(b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 2}', 1),
                               (_SPACES, 12), (b', {"ph": "X", "cat": "kernel", "name": "k", "ts": 3, "dur": 2}]}', 1)]),
])
def test_buffered_text_is_capped_whatever_the_bomb(tmp_path: Path, name: str, parts) -> None:
    """12 MiB inflated from a few KB, held in one piece: refused once 2 MiB is buffered, and
    the reader's Python allocations stay a small multiple of that cap (not the 12 MiB)."""
    import tracemalloc

    path = _gz_stream(tmp_path / f"{name}.json.gz", *parts)
    assert path.stat().st_size < 64 * 1024
    tracemalloc.start()
    try:
        with pytest.raises(TraceError) as err:
            read_trace(path, max_buffered=2 * MiB)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert err.value.reason == "too_large_event"
    assert "traces.max_buffered_bytes" in str(err.value)
    assert peak < 8 * MiB, f"peak {peak / MiB:.1f} MiB"


def test_the_buffer_cap_leaves_real_traces_alone(tmp_path: Path) -> None:
    """A trace of many events is read the same under a 1 MiB cap (it is drained piece by piece)."""
    events = [{"ph": "X", "cat": "kernel", "name": f"k{i % 50}", "ts": i, "dur": 1, "pid": 1, "tid": 7}
              for i in range(60_000)]
    path = _write(tmp_path / "t.json", {"traceEvents": events})
    assert path.stat().st_size > 3 * MiB
    capped, free = read_trace(path, max_buffered=MiB), read_trace(path)
    assert len(capped) == len(free) == 60_000
    assert _events(capped) == _events(free)


def test_zlib_ng_inflates_and_the_standard_library_reads_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """zlib-ng (a declared dependency) inflates; without it the standard library's zlib gives
    the same trace, the same reasons for bad gzip, and the same caps on a gzip bomb."""
    import zlib

    assert traceio.zlib.__name__ == "zlib_ng.zlib_ng"
    fast = read_trace(V100)
    data = SMALL.read_bytes()
    cut = _write(tmp_path / "cut.json.gz", data[: len(data) // 2])
    bad = _write(tmp_path / "bad.json.gz", data[:10] + b"\xff" * 64 + data[74:])
    bomb = _gz_stream(tmp_path / "bomb.json.gz", (b'{"traceEvents": [', 1), (_SPACES, 12), (b"]}", 1))
    seen = []
    for module in (traceio.zlib, zlib):
        monkeypatch.setattr(traceio, "zlib", module)
        assert _events(read_trace(V100)) == _events(fast)
        reasons = []
        for path, kwargs in ((cut, {}), (bad, {}), (bomb, {"max_buffered": 2 * MiB}), (bomb, {"max_bytes": 4 * MiB})):
            with pytest.raises(TraceError) as err:
                read_trace(path, **kwargs)
            reasons.append(err.value.reason)
        seen.append(reasons)
    assert seen[0] == seen[1] == ["truncated", "corrupt", "too_large_event", "too_large"]


def _small_events_gz(path: Path, n: int, name=lambda i: "aten::add", tid=lambda i: 1) -> Path:
    """A .json.gz of ``n`` small valid complete events, written piece by piece."""
    with gzip.open(path, "wb", compresslevel=1) as fh:
        fh.write(b'{"traceEvents": [')
        for start in range(0, n, 10_000):
            piece = [json.dumps({"ph": "X", "cat": "cpu_op", "name": name(i), "ts": i, "dur": 1, "pid": 1,
                                 "tid": tid(i)}) for i in range(start, min(n, start + 10_000))]
            fh.write((b"," if start else b"") + ",".join(piece).encode())
        fh.write(b"]}")
    return path


def test_content_caps_refuse_a_trace_of_too_many_events_or_names_as_soon_as_they_pass(tmp_path: Path) -> None:
    """Issue 41 item 2: the cost of a trace is bounded by what is inside it. The same file is
    read whole without limits (the CLI) and refused by each cap of the agent."""
    many = _small_events_gz(tmp_path / "many.json.gz", 50_000)
    assert len(read_trace(many).ts) == 50_000  # no limits: read whole
    assert len(read_trace(many, limits=traceio.Limits(max_events=50_000)).ts) == 50_000  # exactly the cap: read
    with pytest.raises(TraceError) as err:
        read_trace(many, limits=traceio.Limits(max_events=20_000))
    assert err.value.reason == "too_many_events" and "traces.max_events (20000)" in str(err.value)
    names = _small_events_gz(tmp_path / "names.json.gz", 5_000, name=lambda i: f"n{i}")
    with pytest.raises(TraceError) as err:
        read_trace(names, limits=traceio.Limits(max_names=1_000))
    assert err.value.reason == "too_many_names"
    threads = _small_events_gz(tmp_path / "threads.json.gz", 5_000, tid=lambda i: f"t{i}")
    with pytest.raises(TraceError) as err:
        read_trace(threads, limits=traceio.Limits(max_names=1_000))
    assert err.value.reason == "too_many_names"
    with pytest.raises(TraceError) as err:
        read_trace(many, max_inflated=1024**2)
    assert err.value.reason == "too_large" and "traces.max_inflated_bytes" in str(err.value)


def test_long_names_and_string_threads_are_cut_at_max_name_chars(tmp_path: Path) -> None:
    long = "k" * 5_000
    path = _small_events_gz(tmp_path / "long.json.gz", 3, name=lambda i: long if i else "short",
                            tid=lambda i: "t" * 300 if i == 2 else 7)
    trace = read_trace(path, limits=traceio.Limits(max_name_chars=100))
    names = sorted(trace.names[i] for i in trace.name)
    assert names == ["k" * 100 + "…", "k" * 100 + "…", "short"]
    assert sorted(str(tid) for _, tid in trace.threads) == ["7", "t" * 100 + "…"]
    assert read_trace(path).names.count(long) == 1  # no limits: as written

"""What a bundle says, against real processes and real py-spy: the culprit's line when it
is busy (py-spy's "(active+gil)"), the finding's whole evidence, a summary that follows
the finding while the incident is open, and a rate limit that survives a restart."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from helpers.processes import wait_for
from profagent.analysis.stacks import innermost_frame
from profagent.config import IncidentsConfig
from profagent.contracts import Finding, FindingsSnapshot
from profagent.engine.incidents.bundle import SUMMARY
from profagent.engine.incidents.trigger import IncidentsSource
from profagent.sources.stacks import pyspy
from profagent.state import State
from profagent.target.pid import PidTarget

# Its main thread spins (busy, "(active+gil)"), a second thread sleeps ("(idle)").
BUSY_IDLE = """
import threading, time
def idle():
    time.sleep(3600)
threading.Thread(target=idle, name="idler", daemon=True).start()
def spin():
    x = 0
    while True: x += 1  # one line: py-spy may catch the loop at its test or its body
spin()
"""
SPIN_LINE = 8


def _pyspy() -> str:
    try:
        return pyspy.find_pyspy()
    except pyspy.PySpyProblem as exc:
        pytest.fail(f"py-spy is a test dependency: {exc}")


def _wait_started(pid: int, binary: str) -> str:
    def spinning() -> str | None:
        source = IncidentsSource(IncidentsConfig(), Path("/nonexistent"), State())
        out, _ = source.run_dump(pyspy.dump_text_args(binary, pid, "nonblocking"))
        return out if "spin (" in out else None

    return wait_for(spinning, 30, interval=0.2, what="the child spinning in spin()")


def test_a_busy_culprit_keeps_its_line_in_a_live_dump(children) -> None:
    binary = _pyspy()
    child = children.python(BUSY_IDLE)
    _wait_started(child.pid, binary)
    source = IncidentsSource(IncidentsConfig(), Path("/nonexistent"), State())
    for mode in ("native", "blocking"):
        text, err = source.run_dump(pyspy.dump_text_args(binary, child.pid, mode))
        assert text, err
        assert re.search(r'^Thread \S+ \(active(\+gil)?\): "MainThread"', text, re.M), text  # busy, as py-spy says it
        assert re.search(r'^Thread \S+ \(idle\): "idler"', text, re.M), text
        assert innermost_frame(text) == f"spin (child_0.py:{SPIN_LINE})", text


def _hang(job: str, summary: str, evidence: dict, since: float) -> FindingsSnapshot:
    return FindingsSnapshot((Finding("hang", job, evidence.get("rank"), "critical", summary,
                                     {k: v for k, v in evidence.items() if k != "rank"}, since),), since + 1)


def test_summary_follows_the_finding_and_the_rate_limit_survives_a_restart(children, tmp_path: Path) -> None:
    binary = _pyspy()
    child = children.python(BUSY_IDLE, env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    _wait_started(child.pid, binary)
    tree = PidTarget(child.pid).refresh()
    job = tree.job_id
    [main] = tree.mains()
    state = State()
    state.set_tree(tree)
    config = IncidentsConfig(capture_timeout=30.0)
    rate_file = tmp_path / "state" / "incidents-rate-limits.json"
    folder = tmp_path / "incidents"
    first = {"rank": main.rank, "culprit_ranks": [main.rank], "location": "graph.py:979", "stalled_ranks": [main.rank],
             "unchanged_seconds": 120.0, "stacks": {main.rank: ["_engine_run_backward (graph.py:979)"]}}
    state.publish("findings", _hang(job, f"rank {main.rank} is stuck at graph.py:979 (stack unchanged for 120 s, "
                                    "not in a collective): a deadlock, a blocking read or an endless loop", first, 1000.0), 0.0)
    source = IncidentsSource(config, folder, state, rate_file=rate_file)
    source.start()
    try:
        source.collect(tree)

        def complete() -> Path | None:
            items = source.store.list()
            return Path(items[0].path or "") if len(items) == 1 and items[0].status == "complete" else None

        bundle = wait_for(complete, 60, interval=0.2, what="a complete bundle")
        summary = (bundle / SUMMARY).read_text()
        # The line comes from the bundle's own stacks (the finding said graph.py:979).
        assert f"**Which line**: `spin (child_0.py:{SPIN_LINE})`" in summary, summary
        evidence = json.loads(summary.split("```json\n", 1)[1].split("```", 1)[0])
        assert evidence["location"] == "graph.py:979" and evidence["stacks"] == first["stacks"]  # the whole evidence
        assert json.loads((bundle / "findings.json").read_text())["trigger"]["evidence"]["unchanged_seconds"] == 120.0

        # Only the seconds age: the summary stays as it is.
        aged = {**first, "unchanged_seconds": 125.0}
        state.publish("findings", _hang(job, f"rank {main.rank} is stuck at graph.py:979 (stack unchanged for 125 s, "
                                        "not in a collective): a deadlock, a blocking read or an endless loop", aged, 1000.0), 0.0)
        source.collect(tree)
        assert (bundle / SUMMARY).read_text() == summary

        # The finding changes while the incident is open: the summary says the new one.
        right = {"rank": main.rank, "culprit_ranks": [main.rank], "waiting_ranks": ["1"],
                 "collective": "all_reduce (distributed_c10d.py:3252)", "unchanged_seconds": 126.0}
        reason = (f"rank 1 waits in all_reduce (distributed_c10d.py:3252) for 126 s; the culprit is not in it: "
                  f"rank {main.rank} at spin (child_0.py:{SPIN_LINE})")
        state.publish("findings", _hang(job, reason, right, 1000.0), 0.0)
        source.collect(tree)
        updated = (bundle / SUMMARY).read_text()
        assert f"**What happened**: {reason}" in updated and "**Updated**" in updated and "not in a collective" in updated
        assert f"**Which line**: `spin (child_0.py:{SPIN_LINE})`" in updated
        assert json.loads(updated.split("```json\n", 1)[1].split("```", 1)[0])["waiting_ranks"] == ["1"]
        assert json.loads((bundle / "incident.json").read_text())["reason"] == reason

        # It recovers (the incident closes), then hangs elsewhere within the rate limit: that
        # is another episode, rate-limited, and the closed bundle stays as it was.
        state.publish("findings", FindingsSnapshot((), 1100.0), 0.0)
        source.collect(tree)
        state.publish("findings", _hang(job, "rank 0 is stuck at other.py:1 (stack unchanged for 30 s, not in a collective)",
                                        {**first, "location": "other.py:1"}, 1200.0), 0.0)
        assert (job, "hang", 1) in source.collect(tree).suppressed
        assert (bundle / SUMMARY).read_text() == updated
    finally:
        source.stop()

    # A restart with the same hang still on: no second bundle, the trigger is counted as rate-limited.
    assert (rate_file.stat().st_mode & 0o777) == 0o600
    restarted = IncidentsSource(config, folder, state, rate_file=rate_file)
    restarted.start()
    try:
        snap = restarted.collect(tree)
        assert (job, "hang", 1) in snap.suppressed and (job, "hang", 0) in snap.counts  # counts: this process's
        time.sleep(0.2)  # a capture would have created its folder synchronously, in collect()
        assert len(restarted.store.list()) == 1
        # The same hang goes on, so its bundle is still open: a new diagnosis after the
        # restart rewrites it, stacks, notes and files kept.
        mismatch = {"rank": None, "culprit_ranks": [], "collectives": {"0": "broadcast (c10d.py:1)", "1": "all_reduce (c10d.py:2)"}}
        later = "ranks wait in different collectives for 140 s (mismatched collective order): rank 0 in broadcast"
        state.publish("findings", _hang(job, later, mismatch, 1000.0), 0.0)
        restarted.collect(tree)
        rewritten = (bundle / SUMMARY).read_text()
        assert f"**What happened**: {later}" in rewritten, rewritten
        assert "it first said: rank 0 is stuck at graph.py:979" in rewritten
        assert "**Which rank**: the whole job" in rewritten
        assert f"| {main.rank} | {main.pid} | `spin (child_0.py:{SPIN_LINE})` |" in rewritten  # its own stacks, kept
        assert "`stacks-rank0.txt`" in rewritten
        saved = json.loads((bundle / "findings.json").read_text())
        assert saved["trigger"]["reason"] == later and saved["first_trigger"]["evidence"]["location"] == "graph.py:979"
    finally:
        restarted.stop()


def test_on_demand_trace_copy_refuses_what_is_not_the_ranks_trace(children, tmp_path: Path) -> None:
    """A capture copies the rank's trace only once complete, as a regular file of the rank's
    user (or root) within traces.max_file_bytes; a planted symlink or another user's file
    is refused for good (TraceError with the reason counted by the caller)."""
    import gzip
    import os

    from profagent.engine.incidents.capture import Capture
    from profagent.sources.traces.reader import TraceError

    child = children.python("import time\nwhile True:\n    time.sleep(0.05)\n", env={"RANK": "0", "WORLD_SIZE": "1"})
    tree = wait_for(lambda: (t := PidTarget(child.pid).refresh()) and t.mains() and t, 30, what="the child's tree")
    source = IncidentsSource(IncidentsConfig(), tmp_path / "incidents", State(), max_trace_bytes=4 * 1024 * 1024)
    source.store.ensure_root()
    from profagent.analysis.incidents import Trigger

    capture = Capture(source, Trigger("manual", tree.job_id, None, "test"), tree, source.store.create("manual", "j", 0.0), 0.0, 0)
    seen: dict = {}
    trace = tmp_path / "trace.json"
    whole = json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1,
                                         "ts": float(i), "dur": 0.5} for i in range(2000)]}).encode()
    assert capture._copy_trace(trace, "a.json.gz", 0, seen, 1) is False  # not there yet
    trace.write_bytes(whole[: len(whole) // 2])
    assert capture._copy_trace(trace, "a.json.gz", 0, seen, 1) is False  # still being written
    assert not list(capture.folder.glob(".*.part"))
    trace.write_bytes(whole)
    assert capture._copy_trace(trace, "a.json.gz", 0, seen, 1) is True
    assert gzip.decompress((capture.folder / "a.json.gz").read_bytes()) == whole

    gz = tmp_path / "small.json.gz"  # a gzip trace is copied as it is
    gz.write_bytes(gzip.compress(whole))
    assert capture._copy_trace(gz, "b.json.gz", 0, {}, 2) is True
    assert (capture.folder / "b.json.gz").read_bytes() == gz.read_bytes()
    bomb = tmp_path / "bomb.json.gz"  # 6 MiB of blanks once inflated, a few kB on disk
    bomb.write_bytes(gzip.compress(b'{"traceEvents": [' + b" " * (6 * 1024 * 1024) + b"]}"))

    link = tmp_path / "link.json"
    link.symlink_to(trace)
    foreign = tmp_path / "foreign.json"
    foreign.write_bytes(whole)
    os.chown(foreign, 65534, 65534)
    big = tmp_path / "big.json"
    with big.open("wb") as fh:
        fh.truncate(5 * 1024 * 1024)
    for path, reason in ((link, "symlink"), (foreign, "foreign_owner"), (big, "too_large"), (bomb, "too_large")):
        with pytest.raises(TraceError) as err:
            capture._copy_trace(path, "c.json.gz", 0, {}, 3)
        assert err.value.reason == reason
    assert capture._copy_trace(foreign, "d.json.gz", 65534, {}, 4) is True  # the rank's own user: fine
    assert not (capture.folder / "c.json.gz").exists()


def test_the_capture_asks_for_traces_once_its_dumps_have_resumed_the_ranks(children, tmp_path: Path) -> None:
    """A native dump stops its rank; inside a trace that pause reads as a slow step (run
    113: a false straggler at 2.8x). So the trace request goes out after every dump."""
    from types import SimpleNamespace

    from profagent.analysis.incidents import Trigger
    from profagent.engine.incidents.capture import Capture

    child = children.python("import time\nwhile True:\n    time.sleep(0.05)\n", env={"RANK": "0", "WORLD_SIZE": "1"})
    tree = wait_for(lambda: (t := PidTarget(child.pid).refresh()) and t.mains() and t, 30, what="the child's tree")
    events: list[str] = []

    class Ondemand:
        endpoint = SimpleNamespace(pollers=lambda: [SimpleNamespace(pid=child.pid, can_trace=True)])

        def request(self, wanted, options, timeout):
            running = [p for p in source._dumps if p.poll() is None]
            events.append(f"request ({len(running)} dumps running)")
            assert wanted(SimpleNamespace(pid=child.pid))
            return SimpleNamespace(targets={})  # nothing to wait for

    source = IncidentsSource(IncidentsConfig(capture_timeout=30), tmp_path / "incidents", State(), ondemand=Ondemand())
    source.start()
    wait_for(lambda: "<module>" in source.run_dump(pyspy.dump_text_args(_pyspy(), child.pid, "nonblocking"))[0],
             30, what="the child's interpreter readable")
    run_dump = source.run_dump

    def dump(*args, **kw):
        out = run_dump(*args, **kw)
        events.append("dumped")
        return out

    source.run_dump = dump  # type: ignore[method-assign]
    try:
        capture = Capture(source, Trigger("manual", tree.job_id, None, "test"), tree,
                          source.store.create("manual", tree.job_id, time.time()), time.time(), 0)
        capture.run()
    finally:
        source.stop()
    assert events == ["dumped", "request (0 dumps running)"]
    assert "<module>" in (capture.folder / "stacks-rank0.txt").read_text()


def test_the_bundles_stacks_show_the_redacted_cmdline_not_pyspys_process_line(children, tmp_path: Path) -> None:
    """Issue 41 item 13: py-spy's dump starts "Process N: <whole command line>"; the bundle's
    stacks-rank*.txt shows the process' cmdline label instead, its secret never written."""
    import subprocess
    import sys

    from profagent.analysis.incidents import Trigger
    from profagent.engine.incidents.capture import Capture

    secret = "SECRET-41-do-not-write"
    child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True:\n    time.sleep(0.05)\n",
                              "--api-key", secret], env={"RANK": "0", "WORLD_SIZE": "1", "PATH": "/usr/bin:/bin"},
                             start_new_session=True)
    children.procs.append(child)
    tree = wait_for(lambda: (t := PidTarget(child.pid).refresh()) and t.mains() and t, 30, what="the child's tree")
    source = IncidentsSource(IncidentsConfig(capture_timeout=30), tmp_path / "incidents", State())
    source.start()
    try:
        raw = wait_for(lambda: (out := source.run_dump(pyspy.dump_text_args(_pyspy(), child.pid, "nonblocking"))[0])
                       and "<module>" in out and out, 30, what="the child's interpreter readable")
        assert secret in raw  # what py-spy itself prints
        capture = Capture(source, Trigger("manual", tree.job_id, None, "test"), tree,
                          source.store.create("manual", tree.job_id, time.time()), time.time(), 0)
        capture.run()
    finally:
        source.stop()
    text = (capture.folder / "stacks-rank0.txt").read_text()
    label = tree.mains()[0].cmdline
    assert f"Process {child.pid}: {label}\n" in text and "<module>" in text
    assert secret not in text and secret not in label
    assert not any(secret in p.read_text(errors="replace") for p in capture.folder.rglob("*") if p.is_file())

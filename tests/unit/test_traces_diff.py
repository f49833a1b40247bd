"""`profagent diff` on pairs where the truth is known, each delta checked against a brute
force over the raw JSON written here (plain Python: step spans, sums of durations).

The synthetic pair makes one kernel 2x longer by inserting time: for each instance, from
the latest to the earliest, every event starting at or after its end moves later by its
duration, and every event spanning that point (the ProfilerStep, the thread's ops) grows
by it. So the kernel's own GPU time doubles and each step grows by the time inserted in it.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.paths import shared_traces
from profagent.analysis.trace.diff import verdict
from profagent.cli.diff import diff_paths
from profagent.labels import LABEL_MAX, shorten

SMALL = shared_traces() / "small-gpu-rank0.pt.trace.json.gz"
A100 = shared_traces() / "a100-80gb-rank0.pt.trace.json.gz"
V100 = shared_traces() / "v100-rank0.pt.trace.json.gz"


def _load(path: Path) -> dict:
    with gzip.open(path, "rt") as fh:
        return json.load(fh)


def _write(path: Path, data: dict) -> Path:
    with gzip.open(path, "wt", compresslevel=1) as fh:  # the fastest level: the reader is what is tested
        json.dump(data, fh)
    return path


class Brute:
    """Per-step figures of one trace from its JSON: steps, kernel time inside steps."""

    def __init__(self, data: dict) -> None:
        events = [e for e in data["traceEvents"] if e.get("ph") == "X"]
        spans = sorted({(e["ts"], e["ts"] + e["dur"]) for e in events
                        if e.get("cat") in ("user_annotation", "cpu_op") and e["name"].startswith("ProfilerStep#")})
        self.steps = spans
        self.kernels = [e for e in events if e.get("cat") == "kernel"]

    def step_mean(self) -> float:
        return sum(e - s for s, e in self.steps) / len(self.steps) * 1e-6

    def kernel_per_step(self, name: str) -> float:
        inside = sum(k["dur"] for k in self.kernels if k["name"] == name
                     and any(s <= k["ts"] < e for s, e in self.steps))
        return inside / len(self.steps) * 1e-6


def _top_kernel_in_steps(data: dict) -> str:
    b = Brute(data)
    totals: dict[str, float] = {}
    for k in b.kernels:
        if "nccl" not in k["name"].lower() and any(s <= k["ts"] < e for s, e in b.steps):
            totals[k["name"]] = totals.get(k["name"], 0.0) + k["dur"]
    return max(totals, key=totals.__getitem__)


def _stretch(data: dict, name: str) -> dict:
    """Make every instance of kernel ``name`` 2x longer by inserting time (module doc)."""
    events = data["traceEvents"]
    for k in sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel" and e["name"] == name),
                    key=lambda e: -e["ts"]):
        point, extra = k["ts"] + k["dur"], k["dur"]
        for e in events:
            if e is k or "ts" not in e or e.get("ph") == "M":
                continue
            if e["ts"] >= point:
                e["ts"] += extra
            elif "dur" in e and e["ts"] + e["dur"] > point:
                e["dur"] += extra
        k["dur"] += extra
    return data


def _category_sum(d: dict) -> float:
    return sum(c["delta"] for c in d["contributors"] if c["kind"] == "category")


def test_one_kernel_twice_as_long_is_named_with_its_delta(tmp_path: Path) -> None:
    data = _load(SMALL)
    name = _top_kernel_in_steps(data)
    before = Brute(data)
    slow = _stretch(_load(SMALL), name)
    after = Brute(slow)
    path = _write(tmp_path / "slow.pt.trace.json.gz", slow)

    d = diff_paths(SMALL, path).to_dict()
    assert d["baseline"]["steps"] == len(before.steps) == d["current"]["steps"]
    assert d["step_delta"] == pytest.approx(after.step_mean() - before.step_mean(), rel=1e-9)
    assert d["step_delta"] > 0
    assert _category_sum(d) == pytest.approx(d["step_delta"], rel=1e-9, abs=1e-12)
    kernels = [c for c in d["contributors"] if c["kind"] == "kernel"]
    assert kernels[0]["name"] == name  # the largest kernel change is the stretched kernel
    expected = after.kernel_per_step(name) - before.kernel_per_step(name)
    assert expected > 0
    assert kernels[0]["delta"] == pytest.approx(expected, rel=1e-9)
    for k in kernels[1:]:  # others change only by moving across a step boundary with the inserted time
        expected = after.kernel_per_step(k["name"]) - before.kernel_per_step(k["name"])
        assert k["delta"] == pytest.approx(expected, abs=1e-6), k["name"]
    assert d["verdict"].startswith(f"{d['step_delta'] * 1e3:+.1f} ms per step")
    # the words and the tables give a name up to the label bound (LABEL_MAX), folded: this
    # templated kernel's is longer, so it ends in "…" there, and no sooner
    shown = " ".join(shorten(name).split())
    assert len(name) > LABEL_MAX and shown in " ".join(d["verdict"].split())
    assert shown in " ".join(_cli(str(SMALL), str(path)).stdout.split())


def test_real_pair_from_the_shared_traces() -> None:
    a, v = _load(A100), _load(V100)
    ba, bv = Brute(a), Brute(v)
    d = diff_paths(A100, V100).to_dict()
    assert (d["baseline"]["steps"], d["current"]["steps"]) == (len(ba.steps), len(bv.steps)) == (5, 5)
    assert d["baseline"]["step_mean"] == pytest.approx(ba.step_mean(), rel=1e-9)
    assert d["step_delta"] == pytest.approx(bv.step_mean() - ba.step_mean(), rel=1e-9)
    assert _category_sum(d) == pytest.approx(d["step_delta"], rel=1e-9)
    deltas = [abs(c["delta"]) for c in d["contributors"]]
    assert deltas == sorted(deltas, reverse=True)
    for c in d["contributors"]:
        if c["kind"] == "kernel":
            expected = bv.kernel_per_step(c["name"]) - ba.kernel_per_step(c["name"])
            # float64 at 1.7e15 µs keeps a quarter microsecond: profagent's end - ts rounds
            assert c["delta"] == pytest.approx(expected, rel=1e-6, abs=1e-6), c["name"]
    names_a = {k["name"] for k in ba.kernels if any(s <= k["ts"] < e for s, e in ba.steps)}
    names_v = {k["name"] for k in bv.kernels if any(s <= k["ts"] < e for s, e in bv.steps)}
    for row in d["appeared"]:
        if row["kind"] == "kernel":
            assert row["name"] in names_v - names_a
    for row in d["vanished"]:
        if row["kind"] == "kernel":
            assert row["name"] in names_a - names_v
    assert any(r["kind"] == "kernel" for r in d["vanished"])  # different models: kernels differ


def test_a_run_against_itself_is_all_zeros(tmp_path: Path) -> None:
    d = diff_paths(V100, V100)
    data = d.to_dict()
    assert data["step_delta"] == 0.0
    assert all(c["delta"] == 0.0 for c in data["contributors"])
    assert {c["name"] for c in data["contributors"]} == set(data["baseline"]["categories"])
    assert data["appeared"] == [] and data["vanished"] == []
    assert verdict(d).startswith("no change in step time: +0.0 ms per step")


def test_folder_sides_pool_every_rank(tmp_path: Path) -> None:
    """A folder of two ranks running the same steps diffs to zero against one of them."""
    folder = tmp_path / "job"
    folder.mkdir()
    for rank in (0, 1):
        data = _load(SMALL)
        data["distributedInfo"]["rank"] = rank
        _write(folder / f"rank{rank}.pt.trace.json.gz", data)
    d = diff_paths(SMALL, folder).to_dict()
    assert d["current"]["traces"] == 2 and d["current"]["ranks"] == 2
    assert d["current"]["steps"] == 2 * d["baseline"]["steps"]
    assert d["step_delta"] == pytest.approx(0.0, abs=1e-12)
    assert all(abs(c["delta"]) < 1e-12 for c in d["contributors"])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profagent", "diff", *args], capture_output=True, text=True,
                          timeout=300, env={"NO_COLOR": "1", "COLUMNS": "120", "PATH": "/usr/bin:/bin"})


def test_cli_json_and_errors(tmp_path: Path) -> None:
    done = _cli(str(SMALL), str(SMALL), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert {"baseline", "current", "step_delta", "contributors"} <= set(data)
    assert data["baseline"]["step_mean"] > 0
    assert all(set(c) == {"kind", "name", "delta"} for c in data["contributors"])

    broken = tmp_path / "broken.json"
    broken.write_text('{"traceEvents": [{"ph": "X", "cat": "kernel"')
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(SMALL, tmp_path / "ok.pt.trace.json.gz")
    for args, words in (([str(tmp_path / "nope"), str(SMALL)], "does not exist"),
                        ([str(SMALL), str(broken)], "ends early"),
                        ([str(empty), str(SMALL)], "no trace")):
        done = _cli(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert words in done.stderr and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_parallel_reading_keeps_order_and_matches_one_by_one(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from profagent.analysis.trace.report import analyze
    from profagent.cli.load import analyse_all
    from profagent.sources.traces.reader import read_trace

    broken = tmp_path / "broken.json"
    broken.write_text('{"traceEvents": [')
    files = [SMALL, broken, shared_traces() / "mi250-rocm.pt.trace.json.gz", SMALL]
    outcomes = analyse_all(files, 10, progress=True)  # a pool of up to the cores, and the bar
    assert isinstance(outcomes[1], tuple) and outcomes[1][1] == "truncated"
    for path, got in zip(files, outcomes, strict=True):
        if path is not broken:
            assert got == analyze(read_trace(path), 10)


def _read_by(path: Path, *_args: object) -> tuple[str, str]:
    """Stands in for ``load._one`` (module level: pickled by name to the forked worker)."""
    import os

    return (f"{path.name}:{os.getpid()}", "pid")


def test_this_process_reads_its_share_from_the_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes for four traces of one size: this process reads the last two (its half
    by size, from the back), the pool's worker the others unless this process cancelled
    them before the worker began (here it may: a trace takes no time); each once, in order.
    The ticks are all counted on return (the pool's thread that calls them is joined)."""
    import os

    from profagent.cli import load

    files = []
    for i in range(4):
        files.append(tmp_path / f"rank{i}.json")
        files[-1].write_bytes(b" " * 1000)
    monkeypatch.setattr(load, "_one", _read_by)
    ticks = []
    got = [message for message, _ in load._pool_and_here(files, 2, lambda: ticks.append(1), 10, False, False)]
    assert [g.split(":")[0] for g in got] == [f.name for f in files] and len(ticks) == 4
    by = [int(g.split(":")[1]) for g in got]
    assert by[2] == by[3] == os.getpid()


def test_kernels_kept_for_a_diff_are_bounded(tmp_path: Path) -> None:
    """A trace with 600 distinct kernels: the 500 largest are kept, the rest summed as other."""
    from profagent.analysis.trace.report import IN_STEPS_KEPT, analyze
    from profagent.sources.traces.reader import read_trace

    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 100_000, "pid": 1, "tid": 1}]
    events += [{"ph": "X", "cat": "kernel", "name": f"k{i}", "ts": 10 * i, "dur": 1 + i / 1000, "pid": 0, "tid": 7}
               for i in range(600)]
    path = tmp_path / "many.json"
    path.write_text(json.dumps({"traceEvents": events}))
    kernels = analyze(read_trace(path), in_steps=True).in_steps["kernels"]
    assert len(kernels) == IN_STEPS_KEPT + 1 and "k599" in kernels and "k0" not in kernels
    assert kernels["other"] == pytest.approx(sum(1 + i / 1000 for i in range(100)) * 1e-6)
    assert sum(kernels.values()) == pytest.approx(sum(e["dur"] for e in events[1:]) * 1e-6)

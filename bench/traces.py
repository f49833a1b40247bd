"""Trace analysis speed and peak memory: profagent vs HolisticTraceAnalysis (and bare orjson).

    python bench/traces.py [--repeat 3] [--synthetic-mb 520] [--no-hta-large] [--keep DIR] [--job-only]

First a whole-job row: an 8-rank folder (the shared NCCL trace with its rank and world
size set per file), ``profagent analyze --json FOLDER`` against HTA's ``TraceAnalysis``
over the same folder, each a whole process; peak RSS is the sum over each tool's process
tree (both read ranks in worker processes). Then, per trace, two ratios side by side:
- whole process, as a user waits for it: ``profagent analyze --json FILE`` against
  ``python -c "from hta.trace_analysis import TraceAnalysis; TraceAnalysis(trace_dir=D)
  .get_temporal_breakdown()"`` on a folder holding the trace, each a fresh process
  (interpreter start, imports, reading, analysis, output), best of ``--repeat``;
- in-process engine: ``read_trace`` + ``analyze`` against HTA's ``TraceAnalysis`` +
  ``get_temporal_breakdown`` (and ``orjson.loads``, the floor for anything that builds
  dicts), each in its own process after its imports, best of ``--repeat``.

The whole-process "ceiling" is HTA's time over the start-up floor (``profagent analyze --json``
on an empty trace: interpreter, imports, command line, output): the best ratio any reader and
engine could reach with this start-up, reading and analysis taking no time at all.

Peak RSS is each process's own high-water mark (VmHWM; for the whole-process runs, the
child's ru_maxrss from wait4). Cases: every trace in shared/traces/gpu ($SHARED_FIXTURES_DIR,
else the first shared/ walking up from the checkout, as tests/helpers/paths.py), and a synthetic large
trace (``--synthetic-mb``, 0 to skip) made by replicating the A100-80GB trace's events
with shifted timestamps, correlation ids and step numbers, in a temporary folder.
"""

from __future__ import annotations

import argparse
import compileall
import gzip
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The shared fixtures: $SHARED_FIXTURES_DIR, else the first shared/ walking up from the
# checkout (next to it, or further up for a git worktree); the rule of tests/helpers/paths.py.
SHARED_ENV = "SHARED_FIXTURES_DIR"
SHARED = (Path(os.environ[SHARED_ENV]) if os.environ.get(SHARED_ENV) else next(
    (d / "shared" for d in ROOT.parents if (d / "shared").is_dir()), ROOT.parent / "shared")) / "traces" / "gpu"
SOURCE = "a100-80gb-rank0"
TOOLS = ("profagent", "orjson", "hta")
HTA_SCRIPT = (
    "import logging; logging.disable(logging.CRITICAL)\n"
    "from hta.trace_analysis import TraceAnalysis\n"
    "TraceAnalysis(trace_dir={folder!r}).get_temporal_breakdown(visualize=False)\n"
)


# -- one measurement (child process) ----------------------------------------------------
def _run_profagent(path: Path) -> int:
    from profagent.analysis.trace.report import analyze
    from profagent.sources.traces.reader import read_trace

    trace = read_trace(path)
    size = trace.bytes_read
    analyze(trace)
    return size


def _run_orjson(path: Path) -> int:
    import orjson

    if path.suffix == ".gz":
        with gzip.open(path) as fh:
            data = fh.read()
    else:
        data = path.read_bytes()
    orjson.loads(data)
    return len(data)


def _run_hta(path: Path) -> int:
    import logging

    logging.disable(logging.CRITICAL)
    from hta.trace_analysis import TraceAnalysis

    with tempfile.TemporaryDirectory() as d:
        os.symlink(path, Path(d) / path.name)
        analysis = TraceAnalysis(trace_dir=d)
        analysis.get_temporal_breakdown(visualize=False)
    return 0


def child(tool: str, path: Path, repeat: int) -> None:
    import contextlib
    import io

    fn = {"profagent": _run_profagent, "orjson": _run_orjson, "hta": _run_hta}[tool]
    if tool == "hta":
        import hta.trace_analysis  # noqa: F401  (import time is not the tool's speed)
    else:
        import orjson  # noqa: F401

        import profagent.analysis.trace.report  # noqa: F401
    best, best_cpu = float("inf"), float("inf")
    for _ in range(repeat):
        began, cpu = time.perf_counter(), _cpu()
        with contextlib.redirect_stdout(io.StringIO()):
            fn(path)
        best = min(best, time.perf_counter() - began)
        best_cpu = min(best_cpu, _cpu() - cpu)
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so a child would inherit the
    # driver's peak. HTA's pool workers are children: their own peaks count too.
    peak = max(_vm_hwm(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
    print(json.dumps({"seconds": best, "cpu": best_cpu, "peak_rss": peak}))


def _vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cpu() -> float:
    """CPU seconds of this process and its finished children (HTA may parse in a pool)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


# -- the synthetic trace --------------------------------------------------------------------
def make_synthetic(out: Path, target_mb: int) -> Path:
    """Replicate the source trace's events until the JSON is at least ``target_mb``."""
    import orjson

    with gzip.open(SHARED / f"{SOURCE}.pt.trace.json.gz") as fh:
        raw = orjson.loads(fh.read())
    events = raw.pop("traceEvents")
    ts = [e["ts"] for e in events if isinstance(e.get("ts"), (int, float))]
    span = max(ts) - min(ts) + 1000.0
    path = out / "synthetic.pt.trace.json"
    with path.open("wb") as fh:
        head = orjson.dumps(raw)[:-1]  # metadata without the closing brace
        fh.write(head + b', "traceEvents": [\n')
        written, k, first = 0, 0, True
        while written < target_mb * 1e6:
            shift = k * span
            for e in events:
                e = dict(e)
                if isinstance(e.get("ts"), (int, float)):
                    e["ts"] = e["ts"] + shift
                args = e.get("args")
                if isinstance(args, dict) and "correlation" in args:
                    args = dict(args)
                    args["correlation"] = args["correlation"] + k * 10**9
                    e["args"] = args
                if "id" in e and isinstance(e["id"], int):
                    e["id"] = e["id"] + k * 10**9
                name = e.get("name")
                if isinstance(name, str) and name.startswith("ProfilerStep#"):
                    e["name"] = f"ProfilerStep#{int(name[13:]) + k * 1000}"
                chunk = (b"" if first else b",\n") + orjson.dumps(e)
                first = False
                fh.write(chunk)
                written += len(chunk)
            k += 1
        fh.write(b"\n]}\n")
    return path


# -- whole process -----------------------------------------------------------------------------
def _whole_run(argv: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, peak RSS bytes) of one process and its children."""
    began = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - began
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


def measure_whole(tool: str, path: Path, repeat: int) -> dict:
    """Best of ``repeat`` fresh processes, as a user runs the tool."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory(prefix="profagent-bench-hta-") as folder:
        if tool == "hta":
            os.symlink(path, Path(folder) / path.name)  # HTA reads every trace of a folder
            argv = [sys.executable, "-c", HTA_SCRIPT.format(folder=folder)]
        else:
            argv = [sys.executable, "-m", "profagent", "analyze", "--json", str(path)]
        try:
            runs = [_whole_run(argv, env) for _ in range(repeat)]
        except RuntimeError as exc:
            return {"error": str(exc)}
    return {"seconds": min(r[0] for r in runs), "cpu": min(r[1] for r in runs), "peak_rss": max(r[2] for r in runs)}


# -- a whole job: a folder of ranks ------------------------------------------------------------
JOB_SOURCE = "a100-2gpu-nccl"  # the shared trace with NCCL collectives and distributedInfo
JOB_RANKS = 8


def make_job(out: Path, ranks: int = JOB_RANKS) -> Path:
    """A folder of ``ranks`` traces of one job: the NCCL trace with rank and world size set."""
    with gzip.open(SHARED / f"{JOB_SOURCE}.pt.trace.json.gz", "rt") as fh:
        data = json.load(fh)
    folder = out / "job"
    folder.mkdir(exist_ok=True)
    for rank in range(ranks):
        data["distributedInfo"].update(rank=rank, world_size=ranks)
        with gzip.open(folder / f"rank{rank}.pt.trace.json.gz", "wt", compresslevel=1) as fh:
            json.dump(data, fh)
    return folder


def _tree_rss(pid: int) -> int:
    """RSS bytes of ``pid`` and its descendants, from /proc/PID/task/*/children and statm:
    a few small reads (psutil's children() scans every process on the machine, ~2 ms a
    sample on a 2-core machine that the measured tool needs whole)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * PAGE
            for task in os.scandir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(task.path, "children").read_text().split()]
        except (OSError, ValueError, IndexError):  # gone meanwhile
            pass
    return total


PAGE = os.sysconf("SC_PAGE_SIZE")


def _tree_run(argv: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, peak RSS bytes) of a process tree. The wall is the
    exact exit (this thread waits in waitpid); the RSS is the peak of the *sum* over the
    process and its children (both tools read ranks in worker processes, whose memory adds
    up), sampled every 10 ms by a helper thread."""
    import threading

    began = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], _tree_rss(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    proc.wait()
    wall = time.perf_counter() - began
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # cumulative: differences taken by the caller
    return wall, usage.ru_utime + usage.ru_stime, peak[0]


def measure_job(tool: str, folder: Path, repeat: int) -> dict:
    """Whole process over the folder, as a user runs it: ``profagent analyze --json FOLDER``
    against HTA's ``TraceAnalysis(trace_dir=FOLDER).get_temporal_breakdown()``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    if tool == "hta":
        argv = [sys.executable, "-c", HTA_SCRIPT.format(folder=str(folder))]
    else:
        argv = [sys.executable, "-m", "profagent", "analyze", "--json", str(folder)]
    runs = []
    for _ in range(repeat):
        cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        try:
            wall, cpu_after, peak = _tree_run(argv, env)
        except RuntimeError as exc:
            return {"error": str(exc)}
        runs.append((wall, cpu_after - (cpu_before.ru_utime + cpu_before.ru_stime), peak))
    return {"seconds": min(r[0] for r in runs), "cpu": min(r[1] for r in runs), "peak_rss": max(r[2] for r in runs)}


def job_row(out: Path, repeat: int) -> None:
    folder = make_job(out)
    mb = sum(uncompressed_size(p) for p in folder.iterdir()) / 1e6
    prof, hta = measure_job("profagent", folder, repeat), measure_job("hta", folder, repeat)
    print(f"whole job: {JOB_RANKS} ranks of {JOB_SOURCE}, {mb:.0f} MB of JSON, one folder, each tool a whole "
          f"process on {os.cpu_count()} CPUs (peak RSS: the sum over the process and its workers)")
    print(f"  profagent analyze --json FOLDER: {_secs(prof)} s, {_rss(prof)}; "
          f"HTA TraceAnalysis(FOLDER).get_temporal_breakdown(): {_secs(hta)} s, {_rss(hta)}; "
          f"HTA / profagent: {_ratio(prof, hta)} (goal 15x)", flush=True)


# -- driver -----------------------------------------------------------------------------------
def measure(tool: str, path: Path, repeat: int) -> dict:
    res = subprocess.run([sys.executable, __file__, "--child", tool, str(path), "--repeat", str(repeat)],
                         capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        return {"error": (res.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def uncompressed_size(path: Path) -> int:
    if path.suffix != ".gz":
        return path.stat().st_size
    with gzip.open(path) as fh:
        return sum(len(b) for b in iter(lambda: fh.read(1 << 20), b""))


def _ratio(a: dict, b: dict) -> str:
    """b's time over a's: "wall× (CPU×)"."""
    if "seconds" not in a or "seconds" not in b:
        return "-"
    return f"{b['seconds'] / a['seconds']:.1f}x ({b['cpu'] / a['cpu']:.1f}x)"


def _secs(r: dict) -> str:
    return f"{r['seconds']:.2f}" if "seconds" in r else r["error"][:12]


def _rss(r: dict) -> str:
    return f"{r['peak_rss'] / 2**20:.0f} MiB" if "peak_rss" in r else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synthetic-mb", type=int, default=520)
    parser.add_argument("--repeat", type=int, default=3, help="runs per case (best kept); 1 for the large trace")
    parser.add_argument("--no-hta-large", action="store_true", help="skip HTA on the synthetic trace")
    parser.add_argument("--keep", type=Path, help="write the synthetic trace here and keep it")
    parser.add_argument("--job-only", action="store_true", help="only the whole-job row (8 ranks, one folder)")
    parser.add_argument("--child", nargs=2, metavar=("TOOL", "FILE"), help=argparse.SUPPRESS)
    parser.add_argument("--make-synthetic", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), args.repeat)
        return
    if args.make_synthetic:
        print(make_synthetic(args.make_synthetic, args.synthetic_mb))
        return

    # A wheel install is byte-compiled by pip; a checkout run with PYTHONDONTWRITEBYTECODE
    # set would compile every module in every measured process, so compile them once here.
    compileall.compile_dir(ROOT / "src" / "profagent", quiet=1)
    files = sorted(SHARED.glob("*.pt.trace.json.gz"))
    if not files:
        sys.exit(f"no traces in {SHARED}: set {SHARED_ENV} to the folder holding traces/gpu")
    tmp = tempfile.TemporaryDirectory(prefix="profagent-bench-")
    out = args.keep or Path(tmp.name)
    out.mkdir(parents=True, exist_ok=True)
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    job_row(out, args.repeat)
    if args.job_only:
        tmp.cleanup()
        return
    if args.synthetic_mb > 0:  # in a child: this process's peak would be inherited by the measured ones
        began = time.perf_counter()
        made = subprocess.run([sys.executable, __file__, "--make-synthetic", str(out), "--synthetic-mb",
                               str(args.synthetic_mb)], capture_output=True, text=True, check=True)
        files.append(Path(made.stdout.strip().splitlines()[-1]))
        print(f"synthetic trace: {files[-1].stat().st_size / 1e6:.0f} MB in {time.perf_counter() - began:.0f}s",
              file=sys.stderr)

    # The start-up floor: the whole process on an empty trace (interpreter, imports, command
    # line, output; no reading, no analysis). HTA's time over it is the best whole-process
    # ratio any reader and engine could reach with this start-up ("ceiling" below).
    empty = out / "empty.pt.trace.json"
    empty.write_bytes(b'{"traceEvents": []}')
    floor = measure_whole("profagent", empty, max(args.repeat, 5))
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; best of {args.repeat}; "
          "seconds are wall time; ratios are HTA's time over profagent's, wall (CPU)")
    print(f"start-up floor: profagent analyze --json on an empty trace takes {_secs(floor)} s; "
          "ceiling = HTA's whole-process time over that floor, the best ratio with this start-up")
    print(f"{'':<24} {'':>6} | {'whole process: profagent analyze --json vs HTA script':^62} | "
          f"{'in-process: read+analyze vs HTA load+breakdown':^58} |")
    print(f"{'trace':<24} {'MB':>6} | {'profagent':>9} {'RSS':>8} {'HTA':>7} {'RSS':>9} {'ratio':>15} {'ceiling':>8} | "
          f"{'profagent':>9} {'RSS':>8} {'HTA':>7} {'RSS':>9} {'ratio':>15} {'orjson':>7} |")
    for path in files:
        mb = uncompressed_size(path) / 1e6
        large = mb > 100
        repeat = 1 if large else args.repeat
        skip_hta = large and args.no_hta_large
        whole = {t: ({"error": "skipped"} if t == "hta" and skip_hta else measure_whole(t, path, repeat))
                 for t in ("profagent", "hta")}
        inproc = {t: ({"error": "skipped"} if t == "hta" and skip_hta else measure(t, path, repeat)) for t in TOOLS}
        vs_orjson = "-"
        if "seconds" in inproc["orjson"] and "seconds" in inproc["profagent"]:
            vs_orjson = f"{inproc['orjson']['seconds'] / inproc['profagent']['seconds']:.1f}x"
        ceiling = "-"
        if "seconds" in whole["hta"] and "seconds" in floor:
            ceiling = f"{whole['hta']['seconds'] / floor['seconds']:.1f}x"
        name = path.name.replace(".pt.trace.json.gz", "").replace(".pt.trace.json", "")
        print(f"{name:<24} {mb:>6.1f} | {_secs(whole['profagent']):>9} {_rss(whole['profagent']):>8} "
              f"{_secs(whole['hta']):>7} {_rss(whole['hta']):>9} {_ratio(whole['profagent'], whole['hta']):>15} {ceiling:>8} | "
              f"{_secs(inproc['profagent']):>9} {_rss(inproc['profagent']):>8} {_secs(inproc['hta']):>7} "
              f"{_rss(inproc['hta']):>9} {_ratio(inproc['profagent'], inproc['hta']):>15} {vs_orjson:>7} |", flush=True)
    tmp.cleanup()


if __name__ == "__main__":
    main()

"""Trace analysis throughput and peak memory: profagent vs bare orjson vs HolisticTraceAnalysis.

    python bench/traces.py [--synthetic-mb 520] [--repeat 3] [--no-hta-large] [--keep DIR]

Cases (same files for the three tools):
- the shared A100 traces in ../shared/traces/gpu/ (and the V100 one, for comparison);
- a synthetic large trace (>= 500 MB of JSON) made by replicating the A100-80GB trace's
  events with shifted timestamps, correlation ids and step numbers, written as plain
  JSON into a temporary folder (never into the repository).

Tools:
- profagent: ``read_trace`` + ``analyze`` (every figure: steps, breakdown, GPU, tops...);
- orjson: gunzip if needed + ``orjson.loads`` (the floor for anything that builds dicts);
- hta: ``TraceAnalysis(trace_dir)`` (parsing) + ``get_temporal_breakdown()``.

Each (tool, file) runs in its own subprocess so that its peak RSS (ru_maxrss) is its own;
time excludes interpreter start and imports; throughput is MB/s of uncompressed JSON.
"""

from __future__ import annotations

import argparse
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
SHARED = ROOT.parent / "shared" / "traces" / "gpu"
REAL = ["a100-2gpu-nccl", "a100-80gb-rank0", "a100-alexnet-cudasync", "v100-rank0"]
SOURCE = "a100-80gb-rank0"
TOOLS = ("profagent", "orjson", "hta")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--synthetic-mb", type=int, default=520)
    parser.add_argument("--repeat", type=int, default=3, help="runs per small file (best kept)")
    parser.add_argument("--no-hta-large", action="store_true", help="skip HTA on the synthetic trace")
    parser.add_argument("--keep", type=Path, help="write the synthetic trace here and keep it")
    parser.add_argument("--child", nargs=2, metavar=("TOOL", "FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), args.repeat)
        return

    files = [SHARED / f"{name}.pt.trace.json.gz" for name in REAL]
    tmp = tempfile.TemporaryDirectory(prefix="profagent-bench-")
    out = args.keep or Path(tmp.name)
    out.mkdir(parents=True, exist_ok=True)
    if args.synthetic_mb > 0:
        began = time.perf_counter()
        files.append(make_synthetic(out, args.synthetic_mb))
        print(f"synthetic trace: {files[-1].stat().st_size / 1e6:.0f} MB in {time.perf_counter() - began:.0f}s",
              file=sys.stderr)

    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; MB/s = uncompressed "
          "JSON per wall second (per CPU second in brackets)")
    header = f"{'trace':<24} {'MB':>6} " + " ".join(f"{t + ' MB/s':>17} {t + ' RSS':>12}" for t in TOOLS)
    print(header + f" {'vs HTA wall (cpu)':>18} {'vs orjson':>10}")
    for path in files:
        mb = uncompressed_size(path) / 1e6
        large = mb > 100
        row = {}
        for tool in TOOLS:
            if tool == "hta" and large and args.no_hta_large:
                row[tool] = {"error": "skipped"}
                continue
            row[tool] = measure(tool, path, 1 if large else args.repeat)
        cells = []
        for tool in TOOLS:
            r = row[tool]
            if "error" in r:
                cells.append(f"{r['error'][:17]:>17} {'-':>12}")
            else:
                speed = f"{mb / r['seconds']:.1f} ({mb / r['cpu']:.0f})"
                cells.append(f"{speed:>17} {r['peak_rss'] / 2**20:>8.0f} MiB")
        ratio = "-"
        if "seconds" in row["hta"] and "seconds" in row["profagent"]:
            h, p = row["hta"], row["profagent"]
            ratio = f"{h['seconds'] / p['seconds']:.1f}x ({h['cpu'] / p['cpu']:.1f}x)"
        floor = "-"
        if "seconds" in row["orjson"] and "seconds" in row["profagent"]:
            floor = f"{row['orjson']['seconds'] / row['profagent']['seconds']:.1f}x"
        name = path.name.replace(".pt.trace.json.gz", "").replace(".pt.trace.json", "")
        print(f"{name:<24} {mb:>6.1f} " + " ".join(cells) + f" {ratio:>18} {floor:>10}", flush=True)
    tmp.cleanup()


if __name__ == "__main__":
    main()

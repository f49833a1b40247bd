"""Compare what profagent reported on a real GPU with nvidia-smi and with the workloads'
own ground truth (run.sh's output folder). Prints one line per check; exit status 1 if
any check fails."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from statistics import mean

RANK = re.compile(r'rank="(\d+)"')
MIB = 1 << 20


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def metric(path: Path, name: str) -> list[tuple[float, str, float]]:
    """(time, labels, value) of one family from scrape lines "TIME NAME{LABELS} VALUE"."""
    out = []
    for line in path.read_text().splitlines():
        t, series, value = line.split(" ")
        if series.split("{")[0] == name:
            out.append((float(t), series, float(value)))
    return out


def utilisation(r: Path) -> list[tuple[str, bool]]:
    phases = {e["event"]: e["time"] for e in jsonl(r / "gt" / "steady.jsonl")}
    smi = [(float(t), float(u.rstrip(","))) for t, u, _ in (line.split() for line in (r / "smi_A.txt").read_text().splitlines())]
    prof = [(t, v * 100) for t, _, v in metric(r / "prof_A.txt", "profagent_gpu_utilization_ratio")]
    checks = []
    for phase, start, end in (("busy", phases["busy"], phases["idle"]), ("idle", phases["idle"], phases["done"])):
        a = [u for t, u in smi if start + 3 <= t <= end - 1]  # 3 s for NVML's sample period to catch up
        b = [u for t, u in prof if start + 3 <= t <= end - 1]
        ok = bool(a and b) and abs(mean(a) - mean(b)) <= 5
        checks.append((f"A {phase}: GPU utilisation nvidia-smi {mean(a):.1f}% ({len(a)} reads), "
                       f"profagent {mean(b):.1f}% ({len(b)})", ok))
    return checks


def rank_memory(r: Path) -> list[tuple[str, bool]]:
    pids = {str(e["rank"]): e["pid"] for rank in (0, 1) for e in jsonl(r / "gt" / f"rank{rank}.jsonl")
            if e["event"] == "ready"}
    last = max(float(line.split()[0]) for line in (r / "smi_apps_B.txt").read_text().splitlines())
    smi = {int(p.rstrip(",")): int(m) for t, p, m in (line.split() for line in (r / "smi_apps_B.txt").read_text().splitlines())
           if float(t) == last}
    prof: dict[str, float] = {}
    for t, labels, v in metric(r / "prof_B.txt", "profagent_process_gpu_memory_used_bytes"):
        if 'role="main"' in labels and t > last:
            prof[RANK.search(labels).group(1)] = v / MIB
    checks = [(f"B rank {rank}: GPU memory profagent {prof.get(rank, float('nan')):.0f} MiB, "
               f"nvidia-smi PID {pid} {smi.get(pid, float('nan'))} MiB", abs(prof.get(rank, -1) - smi.get(pid, -9)) <= 1)
              for rank, pid in sorted(pids.items())]
    if {"0", "1"} <= prof.keys():
        diff = prof["0"] - prof["1"]
        checks.append((f"B rank 0 - rank 1: {diff:.0f} MiB (its ballast: 3072 MiB)", abs(diff - 3072) <= 64))
    return checks


def trace_steps(r: Path) -> list[tuple[str, bool]]:
    """In-process traces' ProfilerStep#k against the rank's own timing of step k. The last
    traced step is left out: the workload's clock also counts prof.step() stopping the
    profiler and writing the trace, which the trace's step does not hold."""
    checks = []
    for trace in json.loads((r / "analyzeB.json").read_text())["traces"]:
        m = re.search(r"/rank(\d)\.", trace["path"])
        if not m:
            continue
        truth = {e["step"]: e["seconds"] for e in jsonl(r / "gt" / f"rank{m.group(1)}.jsonl") if e["event"] == "step"}
        steps = [(int(s["name"].split("#")[1]), s["seconds"]) for s in trace["steps"]]
        for k, seconds in steps[:-1]:
            ok = abs(seconds - truth[k]) <= max(2e-3, 0.02 * truth[k])
            checks.append((f"B rank {m.group(1)} step {k}: trace {seconds * 1e3:.2f} ms, "
                           f"workload {truth[k] * 1e3:.2f} ms; accelerator {trace['accelerator']}",
                           ok and trace["accelerator"] == "cuda"))
    return checks


def on_demand(r: Path) -> list[tuple[str, bool]]:
    checks = []
    for phase in ("B", "C"):
        try:
            traces = json.loads((r / f"ondemand{phase}.json").read_text())["traces"]
        except (OSError, ValueError, KeyError):
            traces = []
        found = sorted((t["rank"], t["accelerator"]) for t in traces)
        checks.append((f"{phase} on-demand traces (rank, accelerator): {found}", found == [("0", "cuda"), ("1", "cuda")]))
    rc = (r / "jobC.rc").read_text().strip()
    checks.append((f"C the job, traced on demand during its own profiler's window: {rc}", rc.endswith("rc=0")))
    return checks


def main() -> int:
    r = Path(sys.argv[1])
    failed = 0
    for check in (utilisation, rank_memory, trace_steps, on_demand):
        try:
            rows = check(r)
        except (OSError, ValueError, KeyError, AttributeError, IndexError) as exc:
            rows = [(f"{check.__name__}: could not compare ({type(exc).__name__}: {exc})", False)]
        for text, ok in rows:
            failed += not ok
            print(("ok    " if ok else "FAIL  ") + text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

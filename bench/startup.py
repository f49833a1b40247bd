"""Start-up as a user meets it: `profagent --help` and `profagent analyze` in a plain install.

    python bench/startup.py [--runs 10] [--venv DIR]

Builds a venv with a plain ``pip install .`` (no extras: what a user installs, byte-compiled
by pip), unless ``--venv`` names one to reuse, then runs each command ``--runs`` times as a
fresh process through the ``profagent`` console script and prints the best wall and CPU
(user + sys from wait4) next to ``python -c pass`` in the same venv, the floor any Python
command pays. The goal: ``profagent --help`` under 150 ms.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED_ENV = "SHARED_FIXTURES_DIR"  # as tests/helpers/paths.py: else shared/ walking up
GOAL_HELP_MS = 150.0


def shared_traces() -> Path:
    env = os.environ.get(SHARED_ENV)
    base = Path(env) if env else next((d / "shared" for d in ROOT.parents if (d / "shared").is_dir()), None)
    if base is None:
        sys.exit(f"shared fixtures not found: set {SHARED_ENV}")
    return base / "traces" / "gpu"


def best(argv: list[str], runs: int) -> tuple[float, float]:
    """(best wall ms, best CPU ms) over ``runs`` fresh processes."""
    walls, cpus = [], []
    for _ in range(runs):
        began = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        walls.append((time.perf_counter() - began) * 1e3)
        cpus.append((usage.ru_utime + usage.ru_stime) * 1e3)
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"{' '.join(argv)} failed")
    return min(walls), min(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--venv", type=Path, help="reuse this venv (profagent installed in it)")
    args = parser.parse_args()
    tmp = None
    venv = args.venv
    if venv is None:
        tmp = tempfile.TemporaryDirectory(prefix="profagent-startup-")
        venv = Path(tmp.name) / "venv"
        print(f"building a plain venv: pip install {ROOT} (no extras)...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(ROOT)], check=True,
                       env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    python, profagent = str(venv / "bin" / "python"), str(venv / "bin" / "profagent")
    traces = shared_traces()
    cases = [
        ("python -c pass", [python, "-c", "pass"]),
        ("profagent --help", [profagent, "--help"]),
        ("profagent analyze --json mi250-rocm (0.1 MB)", [profagent, "analyze", "--json", str(traces / "mi250-rocm.pt.trace.json.gz")]),
        ("profagent analyze --json v100-rank0 (15 MB)", [profagent, "analyze", "--json", str(traces / "v100-rank0.pt.trace.json.gz")]),
    ]
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; best of {args.runs} fresh processes")
    print(f"{'command':<48} {'wall ms':>8} {'CPU ms':>8}")
    for name, argv in cases:
        wall, cpu = best(argv, args.runs)
        note = ""
        if name == "profagent --help":
            note = f"  goal < {GOAL_HELP_MS:.0f} ms: {'met' if wall < GOAL_HELP_MS else 'NOT met'}"
        print(f"{name:<48} {wall:>8.0f} {cpu:>8.0f}{note}", flush=True)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()

"""What the timeline's probes cost a process the agent does not observe: another user's,
mapping the same libtorch file.

    sudo .venv/bin/python bench/timeline_foreign.py [--pairs 4] [--turns 30000]

A uprobe is placed on a file (an inode), not a process: every process that maps that
libtorch traps at each probed function, observed or not, and the agent then drops its
events (``profagent_timeline_events_total{kind="foreign"}``). Here the timeline source
observes one idle root process that has torch loaded (the probes' reason to exist), while
a process of ``nobody`` runs `record_function` in a loop (two hits a turn: rf_enter and
rf_exit). Each pair runs that loop once without the probes and once with them, in
alternating order; printed: its CPU per turn both ways and the cost of one hit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from timeline import JOB  # noqa: E402  (bench/timeline.py: the same record_function loop)

from profagent.config import TimelineConfig  # noqa: E402
from profagent.contracts import ProcessInfo, ProcessTree  # noqa: E402
from profagent.sources.timeline.source import TimelineSource, capability_problem  # noqa: E402

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
IDLE_RANK = "import time, torch\nprint('ready', flush=True)\ntime.sleep(3600)\n"


def one_run(turns: int, source: TimelineSource | None, tree: ProcessTree | None) -> tuple[float, int]:
    """(nobody's CPU seconds a turn, foreign events the source saw during the run)."""
    job = subprocess.Popen([*NOBODY, sys.executable, "-c", JOB, str(turns), "hits"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, cwd="/")
    assert job.stdout is not None and job.stdin is not None
    assert job.stdout.readline().strip() == "ready"
    before = source.collect(tree).events_foreign if source is not None and tree is not None else 0
    job.stdin.write("go\n")
    job.stdin.flush()
    seconds = float(job.stdout.readline())
    job.wait()
    time.sleep(0.3)  # the reader's last drain
    after = source.collect(tree).events_foreign if source is not None and tree is not None else 0
    return seconds / turns, after - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--turns", type=int, default=30000)
    args = parser.parse_args()
    problem = capability_problem()
    if problem:
        sys.exit(f"bench/timeline_foreign.py: {problem}; run it as root")
    rank = subprocess.Popen([sys.executable, "-c", IDLE_RANK], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        tree = ProcessTree("bench", rank.pid, (ProcessInfo(rank.pid, os.getpid(), 0.0, "main", "0", "0", "1", "bench"),),
                           True)
        per_hit = []
        for i in range(args.pairs):
            runs: dict[bool, tuple[float, int]] = {}
            for probed in ((False, True) if i % 2 == 0 else (True, False)):
                source = None
                if probed:
                    source = TimelineSource(TimelineConfig(), 1.0)
                    source.start()
                    deadline = time.monotonic() + 30
                    while not source.collect(tree).libraries and time.monotonic() < deadline:
                        time.sleep(0.2)
                runs[probed] = one_run(args.turns, source, tree)
                if source is not None:
                    source.stop(budget=10.0)
            (a, _), (b, foreign) = runs[False], runs[True]
            hits = foreign / args.turns
            per_hit.append((b - a) / hits if hits else float("nan"))
            print(f"pair {i + 1}: {a * 1e6:.2f} us a turn unprobed, {b * 1e6:.2f} probed; {hits:.2f} foreign hits a "
                  f"turn; {per_hit[-1] * 1e6:.2f} us a hit", flush=True)
        print(f"\nanother user's process pays {statistics.median(per_hit) * 1e6:.2f} us a hit (median of "
              f"{args.pairs} pairs), in its own CPU time")
    finally:
        rank.kill()
        rank.wait()


if __name__ == "__main__":
    main()

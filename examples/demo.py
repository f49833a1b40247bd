"""`make demo`: a small torch training job with two ranks, and profagent attached to it.

Starts examples/train.py as a torchrun-like launcher (2 ranks, DataLoader workers,
profiler traces into a temporary folder), attaches `profagent attach` to the launcher,
prints the metrics URL and a few live lines of /metrics every few seconds, and stops
everything it started on Ctrl-C (or after --seconds).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_PORT = 19400

# Families shown live, one line per family (the first matching samples).
SHOWN = [
    "profagent_target_up",
    "profagent_collector_up",
    "profagent_process_cpu_seconds_total",
    "profagent_process_resident_memory_bytes",
    "profagent_processes",
    "profagent_gpu_info",
    "profagent_gpu_utilization_ratio",
    "profagent_gpu_power_watts",
    "profagent_process_gpu_memory_used_bytes",
    "profagent_stack_samples_total",
    "profagent_rank_stalled",
    "profagent_traces_total",
    "profagent_trace_step_seconds",
    "profagent_trace_step_breakdown_ratio",
    "profagent_ondemand_processes",
]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_port() -> int:
    if port_free(DEFAULT_PORT):
        return DEFAULT_PORT
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_present() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def show(url: str, per_family: int) -> None:
    try:
        text = urllib.request.urlopen(url, timeout=3).read().decode()
    except OSError as exc:
        print(f"  (scrape failed: {exc})")
        return
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in SHOWN and counts.get(name, 0) < per_family:
            counts[name] = counts.get(name, 0) + 1
            print("  " + line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0, help="stop by itself after this long (0 = until Ctrl-C)")
    parser.add_argument("--every", type=float, default=5, help="seconds between metric printouts")
    parser.add_argument("--lines", type=int, default=2, help="lines shown per metric family")
    args = parser.parse_args()

    port = pick_port()
    trace_dir = Path(tempfile.mkdtemp(prefix="profagent-demo-traces-"))
    print(f"demo: starting a 2-rank torch CPU training job (traces -> {trace_dir})", flush=True)
    job = subprocess.Popen(
        [sys.executable, str(HERE / "train.py"), "--ranks", "2", "--workers", "2", "--trace-dir", str(trace_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    agent_args = [sys.executable, "-m", "profagent", "attach", "--pid", str(job.pid),
                  "--listen", f"127.0.0.1:{port}", "--trace-dir", str(trace_dir)]
    if not gpu_present():
        print("demo: no GPU here, so the GPU source uses the simulated backend (simulated:h100x2)", flush=True)
        agent_args += ["--gpu-backend", "simulated:h100x2"]
    agent = subprocess.Popen(agent_args)
    url = f"http://127.0.0.1:{port}/metrics"
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    began = time.monotonic()
    try:
        while not stop and agent.poll() is None:
            time.sleep(min(args.every, 1.0) if time.monotonic() - began < 3 else args.every)
            if stop or agent.poll() is not None:
                break
            print(f"\n--- {url} (Ctrl-C stops the demo) ---", flush=True)
            show(url, args.lines)
            sys.stdout.flush()
            if args.seconds and time.monotonic() - began >= args.seconds:
                break
    finally:
        print("\ndemo: stopping the agent and the training job", flush=True)
        if agent.poll() is None:
            agent.send_signal(signal.SIGINT)
            try:
                agent.wait(timeout=10)
            except subprocess.TimeoutExpired:
                agent.kill()
        try:
            os.killpg(job.pid, signal.SIGTERM)
            job.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(job.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return 0 if agent.returncode in (0, None, -signal.SIGINT) else agent.returncode


if __name__ == "__main__":
    sys.exit(main())

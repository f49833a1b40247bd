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
    "profagent_gpu_power_usage_watts",
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
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    # Rank lines first: they are the interesting ones (the launcher has rank="").
    lines.sort(key=lambda line: 'rank=""' in line)
    chosen = []
    for line in lines:
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in SHOWN and counts.get(name, 0) < per_family:
            counts[name] = counts.get(name, 0) + 1
            chosen.append(line)
    for line in sorted(chosen, key=lambda line: SHOWN.index(line.split("{", 1)[0].split(" ", 1)[0])):
        print("  " + line)


def on_demand_trace(launcher: int, config: Path) -> None:
    """Take one on-demand trace of rank 0 through the agent, as a user would."""
    try:
        import psutil

        rank0 = min(p.pid for p in psutil.Process(launcher).children())
    except Exception:
        return
    print(f"\ndemo: profagent trace --pid {rank0} --duration-ms 300 (on demand, no code change)", flush=True)
    cmd = [sys.executable, "-m", "profagent", "trace", "--pid", str(rank0), "--duration-ms", "300",
           "--timeout", "40", "--config", str(config)]
    try:
        subprocess.run(cmd, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        print("demo: the on-demand trace did not finish in time", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0, help="stop by itself after this long (0 = until Ctrl-C)")
    parser.add_argument("--every", type=float, default=5, help="seconds between metric printouts")
    parser.add_argument("--lines", type=int, default=2, help="lines shown per metric family")
    args = parser.parse_args()

    port = pick_port()
    work = Path(tempfile.mkdtemp(prefix="profagent-demo-"))
    trace_dir = work / "traces"
    trace_dir.mkdir()
    # Private Kineto and control sockets, so the demo never collides with an agent that
    # already runs on this machine (real deployments use the defaults).
    config = work / "profagent.toml"
    config.write_text(
        f"[ondemand]\nsocket_dir = '{work / 'kineto'}'\ncontrol_socket = '{work / 'control.sock'}'\n"
        f"trace_dir = '{work / 'ondemand'}'\n"
    )
    print(f"demo: starting a 2-rank torch CPU training job; rank 1 writes profiler traces to {trace_dir},"
          " rank 0 is traced on demand", flush=True)
    # KINETO_USE_DAEMON=1 lets `profagent trace` take traces with no code change.
    job = subprocess.Popen(
        [sys.executable, str(HERE / "train.py"), "--ranks", "2", "--workers", "2", "--trace-dir", str(trace_dir), "--profile-every", "150",
         "--profile-ranks", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "KINETO_USE_DAEMON": "1", "KINETO_IPC_SOCKET_DIR": str(work / "kineto")},
    )
    agent_args = [sys.executable, "-m", "profagent", "attach", "--pid", str(job.pid),
                  "--listen", f"127.0.0.1:{port}", "--trace-dir", str(trace_dir), "--config", str(config)]
    if not gpu_present():
        print("demo: no GPU here, so the GPU source uses the simulated backend (simulated:h100x2)", flush=True)
        agent_args += ["--gpu-backend", "simulated:h100x2"]
    agent = subprocess.Popen(agent_args)
    url = f"http://127.0.0.1:{port}/metrics"
    stop = False
    for _ in range(100):  # the agent is up once /healthz answers
        try:
            urllib.request.urlopen(url.replace("/metrics", "/healthz"), timeout=1).read()
            break
        except OSError:
            if agent.poll() is not None:
                break
            time.sleep(0.2)

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    began = time.monotonic()
    traced = False
    next_print = began + 2.0  # let the first samples arrive
    try:
        while not stop and agent.poll() is None:
            now = time.monotonic()
            if now >= next_print:
                next_print = now + args.every
                print(f"\n--- {url} (Ctrl-C stops the demo) ---", flush=True)
                show(url, args.lines)
                sys.stdout.flush()
            if not traced and now - began > 8:
                traced = True
                on_demand_trace(job.pid, config)
                next_print = time.monotonic()
            if args.seconds and time.monotonic() - began >= args.seconds:
                break
            time.sleep(0.2)
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

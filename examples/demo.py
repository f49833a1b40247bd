"""`make demo`: a small torch training job with two ranks, profagent attached, and `profagent top`.

Starts examples/train.py as a torchrun-like launcher (2 ranks, DataLoader workers,
profiler traces into a temporary folder), attaches `profagent attach` to the launcher,
prints the metrics URL, takes one on-demand trace of rank 0 once it polls the Kineto
endpoint, prints every rank's step time and stages from the kernel probes, runs `profagent diagnose`, captures one incident bundle on request and diffs rank 1's
first trace against its latest (`profagent diff`), then shows `profagent top --url` against the agent: full screen when stdout is
a terminal (q or Ctrl-C stops the demo), else a `profagent top --once` snapshot every
--every seconds plus the list of capabilities seen on /metrics. Everything it started is
stopped on Ctrl-C (or after --seconds), and its temporary folder is removed (--keep keeps it).

The job is healthy but for one thing the demo does on purpose: its DataLoader workers
sleep for every sample (--slow-data), so the ranks wait on their input pipeline and
profagent should report ``dataloader_bound`` (PROVOKED) and nothing else. The simulated
GPUs behave like a healthy job's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
PROFAGENT = [sys.executable, "-m", "profagent"]
# What the demo provokes on purpose, and the finding it should produce: every sample
# sleeps this long in a DataLoader worker, so each rank waits on its data most of a step.
SLOW_DATA_SECONDS = 0.0003
PROVOKED = ("dataloader_bound",)
# Without a terminal, rich would cut lines at 80 columns (mid-word for long paths) and end
# long findings in "…": the demo's commands get a width no line of theirs reaches.
WIDE = "400"

# What the demo shows working, as the metric family that proves it.
CAPABILITIES = [
    ("process metrics (host source)", "profagent_process_cpu_seconds_total"),
    ("GPU metrics (gpu source)", "profagent_gpu_utilization_ratio"),
    ("per-rank GPU memory", "profagent_process_gpu_memory_used_bytes"),
    ("Python stacks by category (py-spy)", "profagent_stack_samples_total"),
    ("stall detection", "profagent_rank_stalled"),
    ("watched profiler traces", "profagent_traces_total"),
    ("step time from traces", "profagent_trace_step_seconds"),
    ("step time and stages from kernel probes, no trace", "profagent_step_stage_seconds_total"),
    ("on-demand tracing (Kineto endpoint)", "profagent_ondemand_processes"),
    ("incidents", "profagent_incidents_total"),
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


def child_env() -> dict[str, str]:
    """The environment of the demo's profagent commands."""
    return os.environ if sys.stdout.isatty() else {**os.environ, "COLUMNS": WIDE}


def print_output(cmd: list[str]) -> None:
    """Run a command and print its output without the padding of its full-width table."""
    done = subprocess.run(cmd, timeout=60, check=False, env=child_env(), stdout=subprocess.PIPE, text=True)
    print("\n".join(line.rstrip() for line in done.stdout.splitlines()), flush=True)


def scrape(url: str) -> str:
    try:
        return urllib.request.urlopen(url, timeout=3).read().decode()
    except OSError:
        return ""


def families_with_samples(text: str) -> set[str]:
    return {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def active_findings(base: str) -> dict[str, str]:
    """Finding name -> its summary, for the findings active now (GET /api/findings)."""
    try:
        body = json.loads(scrape(f"{base}/api/findings") or "{}")
    except ValueError:
        return {}
    rows = body.get("findings", []) if isinstance(body, dict) else body
    return {f["finding"]: str(f.get("summary", "")) for f in rows if isinstance(f, dict) and "finding" in f}


def remember(seen: dict[str, str], base: str) -> None:
    """Adds the findings active now to ``seen``, keeping each one's first summary."""
    for name, summary in active_findings(base).items():
        seen.setdefault(name, summary)


def print_findings_seen(seen: dict[str, str]) -> None:
    """Which findings the run showed, and whether the demo provoked each on purpose; an
    unprovoked one with its summary, for the report."""
    if not seen:
        print(f"demo: findings seen: none yet (the demo provokes {', '.join(PROVOKED)})", flush=True)
        return
    print("demo: findings seen: " + ", ".join(
        f"{name} ({'provoked on purpose' if name in PROVOKED else 'NOT provoked: a false alarm, please report it'})"
        for name in sorted(seen)), flush=True)
    for name in sorted(set(seen) - set(PROVOKED)):
        print(f"demo: {name} said: {seen[name]}", flush=True)


def print_capabilities(url: str) -> bool:
    """One line per capability, from a scrape of /metrics; True when all are there."""
    present = families_with_samples(scrape(url))
    print("demo: capabilities seen on /metrics:", flush=True)
    for what, family in CAPABILITIES:
        print(f"  {'ok     ' if family in present else 'waiting'} {what}: {family}", flush=True)
    return all(family in present for _, family in CAPABILITIES)


def wait_for_series(url: str, stop: list[bool], family: str, rank: str, timeout: float) -> bool:
    """Whether /metrics has a ``family`` series of ``rank`` within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not stop[0] and time.monotonic() < deadline:
        if any(line.startswith(family + "{") and f'rank="{rank}"' in line for line in scrape(url).splitlines()):
            return True
        time.sleep(0.5)
    return False


def wait_for_polling(url: str, stop: list[bool], timeout: float = 90.0) -> bool:
    """Whether rank 0 polls the Kineto endpoint (its profagent_ondemand_processes series
    exists): a trace requested earlier has nobody to pick it up."""
    return wait_for_series(url, stop, "profagent_ondemand_processes", "0", timeout)


def wait_for_own_trace(url: str, stop: list[bool], timeout: float = 60.0) -> bool:
    """Whether the agent has taken in a trace that rank 1's own profiler wrote: until then
    it cannot know that rank 1 drops on-demand requests, and a capture would wait for one."""
    return wait_for_series(url, stop, "profagent_trace_step_seconds", "1", timeout)


def on_demand_trace(launcher: int, config: Path) -> None:
    """Take one on-demand trace of rank 0 through the agent, as a user would."""
    try:
        import psutil

        rank0 = min(p.pid for p in psutil.Process(launcher).children())
    except Exception:
        return
    print(f"\ndemo: profagent trace --pid {rank0} --duration-ms 1000 (on demand, no code change)", flush=True)
    cmd = [*PROFAGENT, "trace", "--pid", str(rank0), "--duration-ms", "1000",
           "--timeout", "40", "--config", str(config)]
    try:
        subprocess.run(cmd, timeout=60, check=False, env=child_env())
    except subprocess.TimeoutExpired:
        print("demo: the on-demand trace did not finish in time", flush=True)


def probed_ranks(base: str) -> list[dict]:
    try:
        ranks = [r for job in json.loads(scrape(f"{base}/api/ranks")).get("jobs", []) for r in job.get("ranks", [])]
    except ValueError:
        return []
    probed = [r for r in ranks if (r.get("timeline") or {}).get("p50_seconds") is not None]
    return probed if probed and len(probed) == len(ranks) else []


def print_probed_steps(base: str, stop: list[bool], timeout: float = 60.0) -> None:
    """Each rank's steps from the kernel probes (rank 0 writes no trace of its own), once
    every rank has a few probed steps."""
    deadline = time.monotonic() + timeout
    probed = probed_ranks(base)
    while not probed and not stop[0] and time.monotonic() < deadline:
        time.sleep(1)
        probed = probed_ranks(base)
    if not probed:
        print("demo: no steps from the kernel probes yet (the timeline source needs root; see docs/timeline.md)",
              flush=True)
        return
    print("\ndemo: every rank's steps from kernel probes on libtorch (no trace, no code change):", flush=True)
    for r in probed:
        t = r["timeline"]
        stages = ", ".join(f"{k} {v:.0%}" for k, v in sorted(t["stage_shares"].items(), key=lambda kv: -kv[1]))
        print(f"  rank {r['rank']}: p50 {t['p50_seconds'] * 1e3:.1f} ms, p90 {t['p90_seconds'] * 1e3:.1f} ms, "
              f"{t['steps_per_second']:.1f} steps/s; {stages}", flush=True)


def diagnose_and_capture(base: str, config: Path) -> None:
    """What is wrong right now (findings), then an incident bundle taken on request, as a
    user would when something looks off (a hang or a regression triggers one by itself)."""
    print(f"\ndemo: profagent diagnose --url {base}", flush=True)
    subprocess.run([*PROFAGENT, "diagnose", "--url", base], timeout=60, check=False, env=child_env())
    print("\ndemo: profagent incidents capture --reason 'demo' (stacks of every rank, findings, metrics, traces)",
          flush=True)
    subprocess.run([*PROFAGENT, "incidents", "capture", "--config", str(config), "--reason", "demo"],
                   timeout=90, check=False, env=child_env())
    subprocess.run([*PROFAGENT, "incidents", "list", "--url", base], timeout=60, check=False, env=child_env())


def _interrupt(proc: subprocess.Popen, timeout: float) -> None:
    """SIGINT (profagent's clean stop), then SIGKILL if it is still running after ``timeout`` s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def diff_traces(trace_dir: Path) -> None:
    """`profagent diff` of rank 1's first trace against its latest: "my run got slower?"."""
    traces = sorted((p for p in trace_dir.rglob("*.json*") if not p.name.endswith(".tmp")), key=lambda p: p.stat().st_mtime)
    if len(traces) < 2:
        print(f"\ndemo: profagent diff needs two traces; {len(traces)} so far (rank 1 writes one every 40 steps)",
              flush=True)
        return
    print(f"\ndemo: profagent diff {traces[0].name} {traces[-1].name} (the first trace as the baseline)", flush=True)
    subprocess.run([*PROFAGENT, "diff", str(traces[0]), str(traces[-1])], timeout=120, check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0, help="stop by itself after this long (0 = until Ctrl-C)")
    parser.add_argument("--every", type=float, default=5, help="seconds between `profagent top --once` snapshots when not a terminal")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (agent log, traces, incident bundle)")
    args = parser.parse_args()

    port = pick_port()
    work = Path(tempfile.mkdtemp(prefix="profagent-demo-"))
    trace_dir = work / "traces"
    trace_dir.mkdir()
    # Private Kineto and control sockets, so the demo never collides with an agent that
    # already runs on this machine (real deployments use the defaults).
    config = work / "profagent.toml"
    config.write_text(
        f"state_dir = '{work / 'state'}'\n"
        f"[ondemand]\nsocket_dir = '{work / 'kineto'}'\ncontrol_socket = '{work / 'control.sock'}'\n"
        f"trace_dir = '{work / 'ondemand'}'\n"
        # rank 1 profiles itself, so its on-demand trace never comes: wait less than 60 s for it,
        # but long enough for rank 0 on a loaded machine (it missed 30 s once, beside the suite)
        "[incidents]\ncapture_timeout = 45\n"
        # Rank 1 profiles itself all along with memory profiling on, which slows its traced
        # steps, while rank 0 is traced on demand (once, and again by the incident capture),
        # with other step markers: differences of the demo's making, not a straggler (real
        # jobs trace their ranks alike), so only 2x the other rank counts here.
        "[findings]\nstraggler_ratio = 2.0\n"
    )
    # The socket folder must exist before the job starts: libkineto binds its client socket
    # there once, at start-up, and never polls if it cannot ("FabricManager not initialized").
    (work / "kineto").mkdir(mode=0o755)
    print(f"demo: starting a 2-rank torch CPU training job; rank 1 writes profiler traces to {trace_dir},"
          " rank 0 is traced on demand", flush=True)
    print(f"demo: on purpose, its DataLoader workers sleep {SLOW_DATA_SECONDS * 1000:g} ms per sample, so the ranks"
          f" wait on their data: profagent should report {', '.join(PROVOKED)} (provoked), and nothing else", flush=True)
    # KINETO_USE_DAEMON=1 lets `profagent trace` take traces with no code change.
    # One DataLoader worker per rank: with two, their batches come in pairs and the steps
    # alternate ~5 ms and ~70 ms, so a few traced steps make a rank look 2x slower or faster
    # than the other (a false straggler); one worker gives every step the same wait.
    # Rank 1 profiles 4 steps of every 44 (about every 2 s), so libkineto on rank 1 is busy
    # when `incidents capture` asks it for a trace.
    job = subprocess.Popen(
        [sys.executable, str(HERE / "train.py"), "--ranks", "2", "--workers", "1", "--trace-dir", str(trace_dir), "--profile-every", "40",
         "--profile-ranks", "1", "--slow-data", str(SLOW_DATA_SECONDS), "--step-sleep", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "KINETO_USE_DAEMON": "1", "KINETO_IPC_SOCKET_DIR": str(work / "kineto")},
    )
    agent_args = [*PROFAGENT, "attach", "--pid", str(job.pid),
                  "--listen", f"127.0.0.1:{port}", "--trace-dir", str(trace_dir), "--config", str(config)]
    if not gpu_present():
        print("demo: no GPU here, so the GPU source uses the simulated backend (simulated:h100x2)", flush=True)
        agent_args += ["--gpu-backend", "simulated:h100x2"]
    agent_log = (work / "agent.log").open("wb")
    # Its own session: Ctrl-C reaches the demo (and `top`), which stops the agent itself.
    agent = subprocess.Popen(agent_args, stdout=agent_log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    url = f"{base}/metrics"
    stop = [False]

    def on_signal(*_: object) -> None:
        stop[0] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    began = time.monotonic()
    try:
        return run(args, agent, work, base, url, config, job, stop, began)
    finally:
        agent_log.close()
        if args.keep:
            print(f"demo: kept {work} (--keep)", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
            print(f"demo: removed {work} (--keep keeps it)", flush=True)


def run(args: argparse.Namespace, agent: subprocess.Popen, work: Path, base: str, url: str, config: Path,
        job: subprocess.Popen, stop: list[bool], began: float) -> int:
    """Everything after the start: stops the agent and the job on the way out."""
    top: subprocess.Popen | None = None
    seen: dict[str, str] = {}  # findings active at any check, with their first summary
    watching = False
    try:
        for _ in range(150):  # the agent is up once /healthz answers
            if stop[0] or agent.poll() is not None or scrape(f"{base}/healthz").strip() == "ok":
                break
            time.sleep(0.2)
        if agent.poll() is not None:
            print(f"demo: the agent exited ({agent.returncode}); its log:\n{(work / 'agent.log').read_text()}", flush=True)
            return 1
        print(f"demo: profagent attached; metrics on {url} (agent log: {work / 'agent.log'})", flush=True)
        print(f"demo: try `curl -s {url} | grep ^profagent_` in another terminal", flush=True)
        print("demo: waiting for rank 0 to poll the Kineto endpoint (profagent_ondemand_processes)...", flush=True)
        if wait_for_polling(url, stop):
            on_demand_trace(job.pid, config)
        elif not stop[0]:
            print("demo: rank 0 did not poll the Kineto endpoint in time: no on-demand trace", flush=True)
        watching = True
        remember(seen, base)
        if not stop[0]:
            print_probed_steps(base, stop)
        if not stop[0] and not wait_for_own_trace(url, stop) and not stop[0]:
            print("demo: rank 1's first trace has not come in yet; the capture may wait for its on-demand trace",
                  flush=True)
        if not stop[0]:
            diagnose_and_capture(base, config)
            remember(seen, base)
        if not stop[0]:
            diff_traces(work / "traces")
        top_cmd = [*PROFAGENT, "top", "--url", base]
        if sys.stdout.isatty() and not stop[0]:
            print(f"\ndemo: {' '.join(['profagent', *top_cmd[3:]])}  (q or Ctrl-C stops the demo)", flush=True)
            time.sleep(1.5)
            top = subprocess.Popen(top_cmd)
            while not stop[0] and top.poll() is None and agent.poll() is None:
                if args.seconds and time.monotonic() - began >= args.seconds:
                    break
                remember(seen, base)
                time.sleep(1)
            return 0
        all_seen = False
        next_print = time.monotonic()
        while not stop[0] and agent.poll() is None:
            now = time.monotonic()
            if now >= next_print:
                next_print = now + args.every
                print(f"\n--- profagent top --once --url {base}   (metrics: {url}; Ctrl-C stops the demo) ---", flush=True)
                print_output([*top_cmd, "--once"])
                remember(seen, base)
                if not all_seen:
                    all_seen = print_capabilities(url)
            if args.seconds and time.monotonic() - began >= args.seconds:
                break
            time.sleep(0.2)
        if not all_seen:
            print_capabilities(url)
        return 0
    finally:
        if top is not None:
            _interrupt(top, timeout=5)
        if watching:
            print_findings_seen(seen)
        print("\ndemo: stopping the agent and the training job", flush=True)
        _interrupt(agent, timeout=10)
        try:
            os.killpg(job.pid, signal.SIGTERM)
            job.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(job.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    sys.exit(main())

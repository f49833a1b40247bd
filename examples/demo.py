"""`make demo`: a small torch training job with two ranks, profagent attached, each capability once.

Starts examples/train.py as a torchrun-like launcher (2 ranks, DataLoader workers, rank 1
writing profiler traces), attaches `profagent attach`, then shows in turn: every rank's
steps from the kernel probes, an on-demand trace of rank 0, `profagent diagnose`, an
incident bundle, `profagent diff` of rank 1's traces around a change the demo makes on
purpose, and `profagent top` (full screen until q in a terminal; else one `--once`
snapshot and the capabilities seen on /metrics). Without a terminal it ends by itself
with a summary; Ctrl-C (or --seconds) stops it sooner. Everything it started is stopped
and its temporary folder removed (--keep keeps it).

The job is healthy but for one thing done on purpose: its DataLoader workers sleep for
every sample, so profagent should report ``dataloader_bound`` and nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from profagent.exporters.api.ranks_doc import RankRow, read_ranks

HERE = Path(__file__).resolve().parent
DEFAULT_PORT = 19400
PROFAGENT = [sys.executable, "-m", "profagent"]
# What the demo provokes on purpose, and the finding it should produce: every sample
# sleeps this long in a DataLoader worker, so each rank waits on its data most of a step.
SLOW_DATA_SECONDS = 0.0003
PROVOKED = ("dataloader_bound",)
# The on-demand trace records this many whole optimizer steps of rank 0.
TRACED_STEPS = 5
# The change the demo makes on purpose before `profagent diff` (examples/train.py --extra-work-file).
EXTRA_WORK_MS = 40
# The first step figures wait for this many probed steps of every rank.
FIRST_STEPS = 10
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


def capture_output(cmd: list[str]) -> str:
    """A command's output without the padding of its full-width table."""
    done = subprocess.run(cmd, timeout=60, check=False, env=child_env(), stdout=subprocess.PIPE, text=True)
    return "\n".join(line.rstrip() for line in done.stdout.splitlines())


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


def print_capabilities(present: set[str]) -> None:
    """One line per capability: whether its family has samples on /metrics."""
    print("\ndemo: capabilities seen on /metrics:", flush=True)
    for what, family in CAPABILITIES:
        print(f"  {'ok     ' if family in present else 'missing'} {what}: {family}", flush=True)


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


def on_demand_trace(launcher: int, config: Path, report: dict[str, str]) -> None:
    """Take one on-demand trace of rank 0 through the agent, as a user would: five whole
    optimizer steps, so the analysis has steps to show; an analysis without one is not
    printed, the demo says why instead."""
    try:
        import psutil

        rank0 = min(p.pid for p in psutil.Process(launcher).children())
    except Exception:
        report["on-demand trace"] = "not taken: rank 0 was not found"
        return
    print(f"\ndemo: profagent trace --pid {rank0} --iterations {TRACED_STEPS} (rank 0's next {TRACED_STEPS} optimizer"
          " steps, on demand, no code change; the profiler slows the steps it records)", flush=True)
    cmd = [*PROFAGENT, "trace", "--pid", str(rank0), "--iterations", str(TRACED_STEPS),
           "--timeout", "40", "--config", str(config)]
    try:
        done = subprocess.run(cmd, timeout=60, check=False, env=child_env(), stdout=subprocess.PIPE, text=True)
    except subprocess.TimeoutExpired:
        print("demo: the on-demand trace did not finish in time", flush=True)
        report["on-demand trace"] = "not finished in 60 s"
        return
    out = "\n".join(line.rstrip() for line in done.stdout.splitlines())
    if "no events to analyse" in out:
        # libkineto wrote the file, but nothing of a step is in it: an analysis would be empty
        print("\n".join(line for line in out.splitlines() if "no events to analyse" not in line), flush=True)
        print("demo: libkineto wrote that trace without a whole step in it (it began tracing as the request"
              " expired, or the rank stopped stepping): no analysis to show", flush=True)
        report["on-demand trace"] = "written, but without a step to analyse"
        return
    print(out, flush=True)
    steps = len(re.findall(r"^│ iteration \d+ ", out, re.M)) or len(re.findall(r"^│ ProfilerStep#\d+ ", out, re.M))
    report["on-demand trace"] = f"rank 0, {steps} steps analysed" if done.returncode == 0 else \
        f"failed (exit {done.returncode})"


def probed_ranks(base: str) -> list[RankRow]:
    try:
        doc = read_ranks(json.loads(scrape(f"{base}/api/ranks")))  # the records `profagent top` reads
    except ValueError:
        return []
    ranks = [r for job in doc.jobs for r in job.ranks]
    # a few steps of each rank, so the quantiles are not of the first step or two
    probed = [r for r in ranks if r.timeline is not None and r.timeline.p50_seconds is not None
              and r.timeline.p90_seconds is not None and r.timeline.steps_per_second is not None
              and r.timeline.optimizer_steps >= FIRST_STEPS]
    return probed if probed and len(probed) == len(ranks) else []


def print_probed_steps(base: str, stop: list[bool], began: float, report: dict[str, str], timeout: float = 60.0) -> None:
    """Each rank's steps from the kernel probes (rank 0 writes no trace of its own), once
    every rank has a few probed steps: the demo's first answer."""
    deadline = time.monotonic() + timeout
    probed = probed_ranks(base)
    while not probed and not stop[0] and time.monotonic() < deadline:
        time.sleep(0.5)
        probed = probed_ranks(base)
    if not probed:
        print("demo: no steps from the kernel probes (the timeline source needs root; see docs/timeline.md)",
              flush=True)
        report["steps from kernel probes"] = "none (the timeline source needs root)"
        return
    first = time.monotonic() - began
    print(f"\ndemo: every rank's steps from kernel probes on libtorch (no trace, no code change), over the steps"
          f" since the probes were placed ({first:.0f} s after the demo started; later figures cover the last"
          " 60 s, timeline.window_seconds):", flush=True)
    for r in probed:
        t = r.timeline
        assert t is not None and t.p50_seconds is not None and t.p90_seconds is not None  # probed_ranks keeps these
        stages = ", ".join(f"{k} {v:.0%}" for k, v in sorted(t.stage_shares.items(), key=lambda kv: -kv[1]))
        print(f"  rank {r.rank}: p50 {t.p50_seconds * 1e3:.1f} ms, p90 {t.p90_seconds * 1e3:.1f} ms, "
              f"{t.steps_per_second:.1f} steps/s over {t.optimizer_steps} steps; {stages}", flush=True)
    report["steps from kernel probes"] = f"first shown {first:.0f} s after the demo started"


def diagnose_and_capture(base: str, config: Path, report: dict[str, str]) -> None:
    """What is wrong right now (findings), then an incident bundle taken on request, as a
    user would when something looks off (a hang or a regression triggers one by itself)."""
    print(f"\ndemo: profagent diagnose --url {base}   (its steps: the last 60 s, so rank 0's traced steps too)",
          flush=True)
    subprocess.run([*PROFAGENT, "diagnose", "--url", base], timeout=60, check=False, env=child_env())
    print("\ndemo: profagent incidents capture --reason 'demo' (stacks of every rank, findings, metrics, traces)",
          flush=True)
    done = subprocess.run([*PROFAGENT, "incidents", "capture", "--config", str(config), "--reason", "demo"],
                          timeout=90, check=False, env=child_env(), stdout=subprocess.PIPE, text=True)
    print(done.stdout.rstrip(), flush=True)
    captured = re.search(r"^incident (\S+):", done.stdout, re.M)
    report["incident bundle"] = f"{captured.group(1)}" if captured else "not captured"
    subprocess.run([*PROFAGENT, "incidents", "list", "--url", base], timeout=60, check=False, env=child_env())


def picture_of_steps(base: str, work: Path, report: dict[str, str]) -> None:
    """Every rank's recent steps as one picture (Chrome's trace event format, which Perfetto
    opens): stages as slices, each collective call with its lag behind the first rank."""
    picture = work / "timeline.json"
    print(f"\ndemo: profagent timeline --url {base} --seconds 20 -o {picture}   (every rank's steps, from the probes)",
          flush=True)
    done = subprocess.run([*PROFAGENT, "timeline", "--url", base, "--seconds", "20", "-o", str(picture)],
                          timeout=60, check=False, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if done.returncode != 0 or not picture.is_file():
        print(done.stdout.rstrip() or "demo: no picture written", flush=True)
        report["picture of the steps"] = "not written"
        return
    events = json.loads(picture.read_text()).get("traceEvents", [])
    steps: dict[str, int] = {}
    names = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    for e in events:
        if e.get("cat") == "step" and e.get("ph") == "X":
            track = str(names.get((e.get("pid"), e.get("tid")), "?")).split(" (")[0]
            steps[track] = steps.get(track, 0) + 1
    collectives = sum(1 for e in events if e.get("cat") == "collective")
    tracks = ", ".join(f"{track} {n} steps" for track, n in sorted(steps.items()))
    print(f"demo: wrote {picture}: {tracks}; {collectives} collective calls with their lags. Open it at"
          " https://ui.perfetto.dev (Open trace file) or in chrome://tracing; every incident bundle holds one too"
          " (timeline.json). The demo's folder goes at its end unless it runs with --keep.", flush=True)
    report["picture of the steps"] = f"{tracks} ({picture.name})"


def _interrupt(proc: subprocess.Popen, timeout: float) -> None:
    """SIGINT (profagent's clean stop), then SIGKILL if it is still running after ``timeout`` s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def written(path: Path) -> bool:
    """Whether the profiler has finished writing a trace: the whole gzip stream and JSON read."""
    import gzip

    try:
        data = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
        return isinstance(json.loads(data), dict)
    except (OSError, EOFError, ValueError):
        return False


def rank1_traces(trace_dir: Path) -> list[Path]:
    """Rank 1's finished traces, oldest first."""
    return sorted((p for p in trace_dir.glob("rank1*.json*") if not p.name.endswith(".tmp") and written(p)),
                  key=lambda p: p.stat().st_mtime)


def diff_on_purpose(trace_dir: Path, extra_work: Path, stop: list[bool], report: dict[str, str],
                    timeout: float = 60.0) -> None:
    """`profagent diff` of rank 1's trace before a change the demo makes on purpose against
    one after it: "my run got slower, why?" with a known answer. The change is undone."""
    deadline = time.monotonic() + timeout
    while not stop[0] and not rank1_traces(trace_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    before = rank1_traces(trace_dir)
    if not before:
        print("\ndemo: rank 1 wrote no trace in time: no `profagent diff`", flush=True)
        report["diff"] = "not run: no trace of rank 1"
        return
    print(f"\ndemo: on purpose, rank 1 now spends {EXTRA_WORK_MS:g} ms more per step in matrix products, as a code"
          " change would (its DataLoader keeps preparing the next batch meanwhile, so the step grows by less);"
          " its next trace is compared with its last one before the change", flush=True)
    extra_work.touch()
    changed = time.time()
    after: list[Path] = []
    try:
        while not stop[0] and time.monotonic() < deadline:
            # a trace whose recorded steps all came after the change (it records 3 steps, 0.1-0.3 s)
            after = [p for p in rank1_traces(trace_dir) if p.stat().st_mtime > changed + 1.0]
            if after:
                break
            time.sleep(0.5)
    finally:
        extra_work.unlink(missing_ok=True)
    if not after:
        print("demo: rank 1 wrote no trace after the change in time: no `profagent diff`", flush=True)
        report["diff"] = "not run: no trace after the change"
        return
    print(f"demo: profagent diff {before[-1].name} {after[0].name}   (rank 1 is back to its usual steps now)",
          flush=True)
    done = subprocess.run([*PROFAGENT, "diff", str(before[-1]), str(after[0])], timeout=120, check=False,
                          env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print("\n".join(line.rstrip() for line in done.stdout.splitlines()), flush=True)
    verdict = re.search(r"^verdict: (.*)$", done.stdout, re.M)
    report["diff"] = verdict.group(1) if verdict else f"no verdict (exit {done.returncode})"
    found = re.search(r"([\d.]+) ms more self CPU time in op aten::mm", done.stdout)
    if found:
        print(f"demo: the diff names the change: {found.group(1)} ms more in aten::mm per step, where the demo added"
              f" {EXTRA_WORK_MS:g} ms of matrix products. The step time changes by another amount: the DataLoader's"
              " wait hides part of the added work, and varies between two traces of 3 steps each", flush=True)


def explain_top_function(text: str | None) -> None:
    """Say what `top`'s function column shows when the leaf frame is the standard
    library's wait (``text``: a `top --once` snapshot; None: before the live view)."""
    if text is None or "_PollLikeSelector.select" in text:
        print("demo: `top function` is the innermost Python frame of each rank's main thread."
              + (" Where it is" if text is None else " Here") +
              " _PollLikeSelector.select, that is the rank itself waiting for its DataLoader worker's next batch"
              " (DataLoader.__next__ -> multiprocessing Queue.get -> poll), the wait the demo provokes;"
              " `stacks` d = data says so. profagent's own threads are never sampled.", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0,
                        help="stop after this long at most (0: in a terminal until q, else once each capability was shown)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (agent log, traces, incident bundle)")
    args = parser.parse_args()
    began = time.monotonic()  # the figures "N s after the demo started" count from here

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
         "--profile-ranks", "1", "--slow-data", str(SLOW_DATA_SECONDS), "--step-sleep", "0",
         "--extra-work-file", str(work / "extra-work"), "--extra-work-ms", f"{EXTRA_WORK_MS:g}"],
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
    """Everything after the start: each capability once, then `top`; stops the agent and
    the job on the way out, with a summary of what was seen."""
    top: subprocess.Popen | None = None
    seen: dict[str, str] = {}  # findings active at any check, with their first summary
    report: dict[str, str] = {}  # capability -> what the demo saw of it, for the summary
    present: set[str] = set()
    watching = False

    def out_of_time() -> bool:
        return stop[0] or bool(args.seconds and time.monotonic() - began >= args.seconds)

    try:
        for _ in range(150):  # the agent is up once /healthz answers
            if stop[0] or agent.poll() is not None or scrape(f"{base}/healthz").strip() == "ok":
                break
            time.sleep(0.2)
        if agent.poll() is not None:
            print(f"demo: the agent exited ({agent.returncode}); its log:\n{(work / 'agent.log').read_text()}", flush=True)
            return 1
        print(f"demo: profagent attached after {time.monotonic() - began:.0f} s; metrics on {url}"
              f" (agent log: {work / 'agent.log'})", flush=True)
        print(f"demo: try `curl -s {url} | grep ^profagent_` in another terminal", flush=True)
        watching = True
        if not out_of_time():
            print_probed_steps(base, stop, began, report)
        if not out_of_time():
            print("\ndemo: waiting for rank 0 to poll the Kineto endpoint (profagent_ondemand_processes)...", flush=True)
            if wait_for_polling(url, stop):
                on_demand_trace(job.pid, config, report)
            elif not stop[0]:
                print("demo: rank 0 did not poll the Kineto endpoint in time: no on-demand trace", flush=True)
                report["on-demand trace"] = "not taken: rank 0 did not poll"
        remember(seen, base)
        if not out_of_time() and not wait_for_own_trace(url, stop) and not stop[0]:
            print("demo: rank 1's first trace has not come in yet; the capture may wait for its on-demand trace",
                  flush=True)
        if not out_of_time():
            diagnose_and_capture(base, config, report)
            remember(seen, base)
        if not out_of_time():
            picture_of_steps(base, work, report)
        if not out_of_time():
            diff_on_purpose(work / "traces", work / "extra-work", stop, report)
        top_cmd = [*PROFAGENT, "top", "--url", base]
        if sys.stdout.isatty() and not out_of_time():
            print(f"\ndemo: {' '.join(['profagent', *top_cmd[3:]])}  (q or Ctrl-C stops the demo)", flush=True)
            explain_top_function(None)
            time.sleep(3)
            top = subprocess.Popen(top_cmd)
            while not out_of_time() and top.poll() is None and agent.poll() is None:
                remember(seen, base)
                time.sleep(1)
            present = families_with_samples(scrape(url))
            return 0
        # Not a terminal: one snapshot of `top`, then the capabilities, waiting (up to a
        # minute) for any that has not shown yet; then the demo ends by itself.
        deadline = time.monotonic() + 60
        shown_top = False
        while not out_of_time() and agent.poll() is None:
            if not shown_top:
                print(f"\n--- profagent top --once --url {base}   (metrics: {url}) ---", flush=True)
                text = capture_output([*top_cmd, "--once"])
                print(text, flush=True)
                explain_top_function(text)
                shown_top = True
            remember(seen, base)
            present = families_with_samples(scrape(url))
            if all(f in present for _, f in CAPABILITIES) or time.monotonic() >= deadline:
                break
            time.sleep(2)
        print_capabilities(present)
        return 0
    finally:
        if top is not None:
            _interrupt(top, timeout=5)
        if watching:
            print_summary(report, seen, present, began)
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


def print_summary(report: dict[str, str], seen: dict[str, str], present: set[str], began: float) -> None:
    """What the demo showed, capability by capability, in one place at the end."""
    print(f"\ndemo: summary after {time.monotonic() - began:.0f} s:", flush=True)
    for what in ("steps from kernel probes", "on-demand trace", "incident bundle", "picture of the steps", "diff"):
        print(f"  {what}: {report.get(what, 'not reached')}", flush=True)
    if present:
        missing = [what for what, family in CAPABILITIES if family not in present]
        print(f"  capabilities on /metrics: {len(CAPABILITIES) - len(missing)} of {len(CAPABILITIES)}"
              + (f" (missing: {', '.join(missing)})" if missing else ""), flush=True)
    print_findings_seen(seen)


if __name__ == "__main__":
    sys.exit(main())

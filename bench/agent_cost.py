"""The agent's own cost on a real torchrun job: CPU per collector, py-spy's, peak RSS.

    python bench/agent_cost.py [--ranks 2 4 8] [--seconds 60] [--warmup 30]
                               [--traces on off] [--poll on off]

For each combination it starts a real torchrun job (DDP over gloo, CPU, 2 DataLoader
workers per rank), a real `profagent attach --pid LAUNCHER` at default settings, and
measures over ``--seconds`` after ``--warmup``:

- the agent's CPU from /proc (user + system of the agent process, children excluded),
  and the same split by collector from its own ``profagent_collector_cpu_seconds_total``;
- py-spy's CPU twice: the agent's ``profagent_pyspy_cpu_seconds_total`` and, as an
  independent check, the CPU of the agent's reaped children from /proc (cutime + cstime);
- the agent's peak RSS (VmHWM).

``--traces on``: the job writes 10 torch profiler traces a minute into the folder the
agent watches (``--trace-dir``), the ranks taking turns. ``--poll on``: /api/findings is
fetched once a second, as `profagent top` does. CPU time from /proc hardly depends on
the machine's load, so the figures hold on a busy machine; the job itself just runs slower.

Goals (issue #26), for 8 ranks with traces: agent <= 2% of a core, py-spy <= 0.5% of a
core per rank, RSS <= 100 MB. Each row says which goals it misses; exit 1 if the
8-rank-with-traces row misses one.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

GOAL_AGENT = 0.02  # of one core, all collectors together
GOAL_PYSPY_PER_RANK = 0.005
GOAL_RSS = 100e6
TRACES_PER_MINUTE = 10

JOB = r'''
import os, time, signal
import torch, torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

signal.alarm(int(os.environ["BENCH_MAX_SECONDS"]))
trace_dir = os.environ.get("BENCH_TRACE_DIR", "")
per_minute = int(os.environ["BENCH_TRACES_PER_MINUTE"])

class Data(Dataset):
    def __len__(self): return 1 << 30
    def __getitem__(self, i):
        time.sleep(0.002)  # a light decode
        return torch.randn(64), torch.randint(0, 8, ()).item()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(Data(), batch_size=32, num_workers=2, persistent_workers=True)
# Ranks take turns: one trace every 60/per_minute seconds for the whole job.
every = 60.0 / per_minute if per_minute else 0.0
t0 = time.monotonic()
next_slot = rank  # slot k belongs to rank k % world
step_in_trace, prof = 0, None
for step, (x, y) in enumerate(loader):
    if trace_dir and prof is None and time.monotonic() - t0 >= next_slot * every:
        next_slot += world
        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir, worker_name=f"rank{rank}"))
        prof.__enter__()
        step_in_trace = 0
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if prof is not None:
        prof.step()
        step_in_trace += 1
        if step_in_trace == 5:
            prof.__exit__(None, None, None)
            prof = None
    time.sleep(0.02)  # the rest of a step a GPU would take
'''


@dataclass
class Row:
    ranks: int
    traces: bool
    poll: bool
    seconds: float
    agent_cpu: float  # seconds, /proc
    by_collector: dict[str, float]  # seconds, the agent's own account
    pyspy_metric: float
    pyspy_proc: float
    rss_peak: int
    traces_ingested: float

    def misses(self) -> list[str]:
        out = []
        if self.agent_cpu / self.seconds > GOAL_AGENT:
            out.append(f"agent > {GOAL_AGENT:.0%}")
        if self.pyspy_proc / self.seconds / self.ranks > GOAL_PYSPY_PER_RANK:
            out.append(f"py-spy > {GOAL_PYSPY_PER_RANK:.1%}/rank")
        if self.rss_peak > GOAL_RSS:
            out.append("RSS > 100 MB")
        return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def metric(text: str, name: str) -> dict[str, float]:
    """label set text -> value for one family (enough for the few families read here)."""
    out = {}
    for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        out[m.group(1) or ""] = float(m.group(2))
    return out


def by_collector(text: str) -> dict[str, float]:
    values = metric(text, "profagent_collector_cpu_seconds_total")
    return {re.search(r'collector="([^"]+)"', k).group(1): v for k, v in values.items()}


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run_one(ranks: int, traces: bool, poll: bool, seconds: float, warmup: float, tmp: Path) -> Row:
    trace_dir = tmp / f"traces-{ranks}-{int(traces)}-{int(poll)}"
    trace_dir.mkdir()
    script = tmp / "job.py"
    script.write_text(JOB)
    env = dict(os.environ, BENCH_MAX_SECONDS=str(int(warmup + seconds + 120)),
               BENCH_TRACES_PER_MINUTE=str(TRACES_PER_MINUTE if traces else 0), OMP_NUM_THREADS="1")
    if traces:
        env["BENCH_TRACE_DIR"] = str(trace_dir)
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                            "--master-port", str(free_port()), str(script)], env=env, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=(tmp / "job.log").open("ab"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "profagent", "attach", "--pid", str(job.pid), "--listen", f"127.0.0.1:{port}"]
    if traces:
        args += ["--trace-dir", str(trace_dir)]
    agent = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=(tmp / "agent.log").open("ab"))
    stop = threading.Event()
    poller = threading.Thread(target=_poll, args=(base + "/api/findings", stop), daemon=True)
    try:
        _wait_up(base, agent)
        if poll:
            poller.start()
        time.sleep(warmup)
        proc = psutil.Process(agent.pid)
        c0, t0, m0 = proc.cpu_times(), time.monotonic(), get(base + "/metrics")
        time.sleep(seconds)
        c1, t1, m1 = proc.cpu_times(), time.monotonic(), get(base + "/metrics")
        rss = peak_rss(agent.pid)
    finally:
        stop.set()
        agent.send_signal(signal.SIGINT)
        try:
            agent.wait(15)
        except subprocess.TimeoutExpired:
            agent.kill()
        _kill_tree(job)
    cpu0, cpu1 = by_collector(m0), by_collector(m1)
    pyspy = metric(m1, "profagent_pyspy_cpu_seconds_total").get("", 0.0) - \
        metric(m0, "profagent_pyspy_cpu_seconds_total").get("", 0.0)
    ingested = sum(v for k, v in metric(m1, "profagent_traces_total").items() if 'status="ingested"' in k) - \
        sum(v for k, v in metric(m0, "profagent_traces_total").items() if 'status="ingested"' in k)
    return Row(ranks, traces, poll, t1 - t0,
               (c1.user + c1.system) - (c0.user + c0.system),
               {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1},
               pyspy, (c1.children_user + c1.children_system) - (c0.children_user + c0.children_system),
               rss, ingested)


def _kill_tree(job: subprocess.Popen) -> None:
    """Kill torchrun and every process under it: its ranks run in sessions of their own, so
    killing its process group alone left them running (and loading the next run)."""
    try:
        procs = [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]
    except psutil.Error:
        procs = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    psutil.wait_procs(procs, timeout=10)


def _wait_up(base: str, agent: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if agent.poll() is not None:
            raise SystemExit(f"the agent exited ({agent.returncode}); see its log")
        try:
            if get(base + "/healthz").startswith("ok"):
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("the agent did not come up in 60 s")


def _poll(url: str, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        try:
            get(url)
        except OSError:
            pass


def print_row(r: Row) -> None:
    share = {k: v / r.seconds for k, v in sorted(r.by_collector.items(), key=lambda kv: -kv[1]) if v > 0}
    own = {k: v for k, v in share.items() if k != "stacks"}
    stacks_own = (r.by_collector.get("stacks", 0.0) - r.pyspy_metric) / r.seconds
    parts = ", ".join(f"{k} {v:.2%}" for k, v in [("stacks", stacks_own), *own.items()] if v >= 0.0005)
    print(f"{r.ranks:>5} {'on' if r.traces else 'off':>6} {'on' if r.poll else 'off':>4} "
          f"{r.agent_cpu / r.seconds:>8.2%} {r.pyspy_proc / r.seconds:>8.2%} "
          f"{r.pyspy_proc / r.seconds / r.ranks:>9.2%} {r.rss_peak / 2**20:>7.0f} {r.traces_ingested:>6.0f}  "
          f"{'; '.join(r.misses()) or 'met':<22} {parts}")
    print(f"{'':>27}(py-spy by the agent's own count: {r.pyspy_metric / r.seconds:.2%})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--seconds", type=float, default=60.0, help="measured seconds per run (default 60)")
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds before measuring (default 30)")
    ap.add_argument("--traces", choices=["on", "off"], nargs="+", default=["on", "off"])
    ap.add_argument("--poll", choices=["on", "off"], nargs="+", default=["on", "off"])
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="profagent-cost-"))
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; logs in {tmp}")
    print(f"{'ranks':>5} {'traces':>6} {'poll':>4} {'agent':>8} {'py-spy':>8} {'py-spy/rk':>9} "
          f"{'RSS MiB':>7} {'traces':>6}  {'goals (8 ranks+traces)':<22} agent CPU by collector (% of a core)")
    failed = False
    try:
        for ranks, traces, poll in itertools.product(args.ranks, args.traces, args.poll):
            row = run_one(ranks, traces == "on", poll == "on", args.seconds, args.warmup, tmp)
            print_row(row)
            if ranks == 8 and row.traces and row.misses():
                failed = True
    finally:
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

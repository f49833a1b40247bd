"""Item 2 of issue 25: forged traces. A trace counts for a job by kernel credentials only.

A root agent in watch mode watches two real jobs: root's (the victim) and nobody's (the
attacker, allowed one ordinary job of its own). The attacker, a real process of nobody,
writes traces naming the victim's PID into the shared watched folder and into the
on-demand folder, a trace of another machine under its own PID, and a trace naming both
jobs. Each is refused with its reason and never shown; the victim's figures stay those
of its real trace, and the attacker's own honest trace still counts for its own job.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.nobody import NOBODY, as_nobody, nobody_python
from helpers.paths import shared_traces
from helpers.processes import kill_tree, wait_for
from helpers.watch import job_env, token
from profagent.sources.traces.source import TracesSource
from profagent.target.node import Limits, NodeTarget, Rules

SMALL = shared_traces() / "mi250-rocm.pt.trace.json.gz"
SMALL_PID = 597913  # the CPU process of SMALL, on the machine it was taken on
SLEEPER = "import time\nwhile True:\n    time.sleep(0.05)\n"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                       reason="plays a root agent against nobody: needs root and setpriv"),
]


def trace_of(pid: int, rank: int | None = None, scale: float = 1.0) -> str:
    """SMALL as if taken from ``pid`` (its CPU rows renamed), optionally claiming a rank
    and with every duration multiplied by ``scale`` (a slower step). A gloo all_reduce is
    added at the end of its step: a straggler is named only among ranks that communicate."""
    data = json.loads(gzip.decompress(SMALL.read_bytes()))
    step = next(e for e in data["traceEvents"] if e.get("name") == "ProfilerStep#1" and e.get("pid") == SMALL_PID)
    data["traceEvents"].append({"ph": "X", "cat": "cpu_op", "name": "gloo:all_reduce", "pid": SMALL_PID,
                                "tid": step["tid"], "ts": step["ts"] + 0.85 * step["dur"], "dur": 0.1 * step["dur"]})
    for e in data["traceEvents"]:
        if e.get("pid") == SMALL_PID:
            e["pid"] = pid
        if scale != 1.0 and isinstance(e.get("dur"), (int, float)):
            e["dur"] = e["dur"] * scale
    if rank is not None:
        data["distributedInfo"] = {"rank": rank, "world_size": 8, "backend": "nccl"}
    return json.dumps(data)


@pytest.fixture
def folders() -> Iterator[tuple[Path, Path]]:
    """A shared watched folder and an on-demand folder: root's, world-writable and sticky."""
    base = Path(tempfile.mkdtemp(prefix="paw-attrib-"))
    base.chmod(0o755)
    shared, ondemand = base / "shared", base / "ondemand"
    for d in (shared, ondemand):
        d.mkdir()
        d.chmod(0o1777)
    yield shared, ondemand
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def nobody_job(folders) -> Iterator:
    started: list[subprocess.Popen] = []

    def start(env: dict[str, str], code: str = SLEEPER) -> subprocess.Popen:
        started.append(nobody_python(code, env, folders[0].parent))
        return started[-1]

    yield start
    for proc in started:
        kill_tree(proc)


def write_as_nobody(files: dict[Path, str]) -> None:
    """Write each file as nobody (through a script reading the contents from stdin)."""
    code = textwrap.dedent("""
        import json, sys
        for path, text in json.load(sys.stdin).items():
            with open(path + ".tmp", "w") as fh:
                fh.write(text)
            import os
            os.rename(path + ".tmp", path)
    """)
    done = subprocess.run(as_nobody("/usr/bin/python3", "-c", code), input=json.dumps({str(k): v for k, v in files.items()}),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


class Agent:
    """A traces source fed by a NodeTarget (watch mode), ticking like the runtime."""

    def __init__(self, tok: str, shared: Path, ondemand: Path, state: Path) -> None:
        self.target = NodeTarget(Rules(None, (("PAW_TOKEN", tok),), False), Limits(scan_interval=0.1),
                                 settle_seconds=0.0, self_pid=-1)
        self.source = TracesSource([shared, ondemand], state, interval=0.1, settle_seconds=0.3,
                                   strict_dirs=(ondemand,))
        self.tree = self.target.refresh()
        self.snapshot = self.source.collect(self.tree)
        self.source.start()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self.tree = self.target.refresh()
            self.snapshot = self.source.collect(self.tree)

    def counts(self) -> dict[tuple[str, str], int]:
        return {(s, r): n for s, r, n in self.snapshot.counts if n}

    def ranks(self) -> dict[tuple[str, str], float | None]:
        return {(rt.job_id, rt.rank): rt.report.step_mean for rt in self.snapshot.ranks}

    def stop(self) -> None:
        self._stop.set()
        self.source.stop()
        self._thread.join(2)


def test_forged_traces_naming_the_victim_are_refused(children, nobody_job, folders, tmp_path: Path) -> None:
    shared, ondemand = folders
    tok = token()
    victim = children.python(SLEEPER, env=job_env(tok, SLURM_JOB_ID="victim", RANK="0", WORLD_SIZE="1"))
    attacker = nobody_job(job_env(tok, SLURM_JOB_ID="attacker", RANK="0", WORLD_SIZE="1"))
    agent = Agent(tok, shared, ondemand, tmp_path / "state")
    try:
        wait_for(lambda: set(agent.tree.job_status()) == {"victim", "attacker"}, 30, what="both jobs watched")
        # the victim's real trace, written by its user (root)
        (shared / "victim_host_1.pt.trace.json").write_text(trace_of(victim.pid))
        wait_for(lambda: ("victim", "0") in agent.ranks(), 30, what="the victim's trace ingested")
        before = agent.ranks()[("victim", "0")]
        assert before is not None

        write_as_nobody({
            # a slower fake rank 7 and a slower rank 0 of the victim's job, in the shared folder
            shared / "forged-rank7.pt.trace.json": trace_of(victim.pid, rank=7, scale=5.0),
            shared / f"host_{victim.pid}.1.pt.trace.json": trace_of(victim.pid, scale=5.0),
            # libkineto's name for a trace of the victim, in the on-demand folder
            ondemand / f"profagent_x_{victim.pid}.json": trace_of(victim.pid, scale=5.0),
            # another machine's trace, under the attacker's own PID, in the on-demand folder
            ondemand / f"profagent_y_{attacker.pid}.json": trace_of(SMALL_PID),
            # one trace naming both jobs
            shared / f"host_{attacker.pid}.2.pt.trace.json": trace_of(victim.pid, scale=5.0),
        })
        # and the attacker's honest trace of its own job: still counted, for its own job
        write_as_nobody({ondemand / f"profagent_z_{attacker.pid}.json": trace_of(attacker.pid, scale=2.0)})
        wait_for(lambda: sum(agent.counts().values()) == 7 and agent.snapshot.waiting == 0, 60,
                 what="every trace counted")
        assert agent.counts() == {
            ("ingested", "ok"): 2,  # the victim's real trace, the attacker's own
            ("skipped", "foreign_owner"): 3,  # nobody's files naming only the victim's PID
            ("skipped", "other_process"): 2,  # another machine's PIDs; both jobs' PIDs
        }
        ranks = agent.ranks()
        assert set(ranks) == {("victim", "0"), ("attacker", "0")}  # no fake rank 7
        assert ranks[("victim", "0")] == before  # the victim's figures unchanged
        assert ranks[("attacker", "0")] == pytest.approx(2 * before, rel=0.05)
    finally:
        agent.stop()
        kill_tree(attacker)


def test_a_trace_of_the_jobs_user_in_a_folder_it_cannot_write_is_refused(nobody_job, folders, tmp_path: Path) -> None:
    """Owned by the job's user (a hard link, or a file handed over) but in a folder only
    root may write: not the job's, whatever it says."""
    shared, ondemand = folders
    tok = token()
    locked = shared / "root-only"
    locked.mkdir(mode=0o755)
    job = nobody_job(job_env(tok, SLURM_JOB_ID="nobodyjob", RANK="0"))
    agent = Agent(tok, shared, ondemand, tmp_path / "state")
    try:
        wait_for(lambda: set(agent.tree.job_status()) == {"nobodyjob"}, 30, what="nobody's job watched")
        path = locked / f"host_{job.pid}.1.pt.trace.json"
        path.write_text(trace_of(job.pid))
        os.chown(path, NOBODY, NOBODY)
        wait_for(lambda: sum(agent.counts().values()) == 1, 30, what="the trace counted")
        assert agent.counts() == {("skipped", "foreign_folder"): 1}
        assert agent.ranks() == {}
    finally:
        agent.stop()


# -- the same attack against a real root agent (`profagent watch`), read on /metrics --------

def _victim_ranks(launcher: subprocess.Popen) -> dict[str, int]:
    import psutil

    out = {}
    for child in psutil.Process(launcher.pid).children():
        try:
            rank = child.environ().get("RANK")
        except psutil.Error:
            continue
        if rank is not None:
            out[rank] = child.pid
    return out if len(out) == 2 else {}


def test_a_root_agent_keeps_the_victims_figures_and_straggler(children, nobody_job, folders, run_agent) -> None:
    from helpers.agent import free_port, http_get, parse_metrics
    from helpers.watch import FAKE_TORCHRUN, samples, watch_config

    shared, ondemand = folders
    ondemand.rmdir()  # the agent makes its on-demand folder itself (root's, 1777)
    base = shared.parent
    tok = token()
    config = watch_config(base, tok)
    with config.open("a") as fh:
        fh.write(f"\n[traces]\ndirs = ['{shared}']\nsettle_seconds = 0.3\n"
                 f"[ondemand]\nsocket_dir = '{base / 's'}'\ncontrol_socket = '{base / 'c.sock'}'\n"
                 f"trace_dir = '{ondemand}'\n")
    (base / "s").mkdir()
    victim = children.python(FAKE_TORCHRUN, env=job_env(tok, SLURM_JOB_ID="victim"))
    attacker = nobody_job(job_env(tok, SLURM_JOB_ID="attacker", RANK="0", WORLD_SIZE="1"))
    ranks = wait_for(lambda: _victim_ranks(victim), 30, what="the victim's two ranks")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent = run_agent(["watch", "--config", str(config), "--listen", f"127.0.0.1:{port}"])
    agent.wait_healthy(url, timeout=60)
    wait_for(lambda: ondemand.is_dir(), 30, what="the on-demand folder")

    def steps(job: str) -> dict[str, float]:
        m = parse_metrics(http_get(url + "/metrics"))
        return {lab["rank"]: v for lab, v in samples(m, "profagent_trace_step_seconds", job_id=job)}

    def stragglers() -> set[tuple[str, str]]:
        found = json.loads(http_get(url + "/api/findings"))["findings"]
        return {(f["job_id"], f["rank"]) for f in found if f["finding"] == "straggler"}

    # the victim's real traces: rank 1 is its real straggler
    (shared / "r0.pt.trace.json").write_text(trace_of(ranks["0"]))
    (shared / "r1.pt.trace.json").write_text(trace_of(ranks["1"], scale=2.0))
    before = wait_for(lambda: (s := steps("victim")) and len(s) == 2 and s, 60, what="the victim's step times")
    wait_for(lambda: stragglers() == {("victim", "1")}, 60, what="the victim's real straggler")

    write_as_nobody({
        shared / "fake7.pt.trace.json": trace_of(ranks["0"], rank=7, scale=5.0),  # a fake rank-7 straggler
        shared / f"host_{ranks['1']}.9.pt.trace.json": trace_of(ranks["1"]),  # rank 1 made fast: hides it
        ondemand / f"profagent_x_{ranks['1']}.json": trace_of(ranks["1"]),  # the same, on demand
    })
    write_as_nobody({ondemand / f"profagent_z_{attacker.pid}.json": trace_of(attacker.pid)})  # its own, honest

    def rejected() -> dict[str, float]:
        m = parse_metrics(http_get(url + "/metrics"))
        return {lab["reason"]: v for lab, v in samples(m, "profagent_traces_rejected_total", status="skipped")}

    wait_for(lambda: rejected().get("foreign_owner") == 3 and steps("attacker"), 60,
             what="the forgeries refused and the attacker's own trace shown")
    assert steps("victim") == before  # no rank 7, rank 1 still slow
    assert steps("attacker") == {"0": pytest.approx(before["0"], rel=0.05)}
    assert stragglers() == {("victim", "1")}  # the victim's real straggler is still shown

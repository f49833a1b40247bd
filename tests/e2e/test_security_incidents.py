"""Incident captures against an unprivileged user (issue 25, items 6, 7 and 10; issue 41 item 11).

A root `profagent watch` agent (a real subprocess) watches a job of root's (the victim)
and jobs of `nobody` (really run through setpriv). The attacker's job polls the agent's
Kineto endpoint by hand; when a capture asks it for an on-demand trace, it plants
something at the trace path it was given: a 1.5 GB sparse file, a JSON of millions of
``{}``, a FIFO, or nothing at all. The agent must stay within a small memory budget,
finish every capture by incidents.capture_timeout, keep capturing root's job meanwhile,
and never let nobody's bundles evict root's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from helpers.agent import AgentProcess, free_port, http_get, parse_metrics
from helpers.processes import kill_tree, wait_for
from helpers.watch import token

NOBODY = 65534
SETPRIV = shutil.which("setpriv")
CAPTURE_TIMEOUT = 6.0
MAX_TRACE_BYTES = 16 * 1024 * 1024  # traces.max_file_bytes, low for the test
RSS_HEADROOM = 60 * 1024 * 1024  # the agent may grow this much over its idle RSS during an attack
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None, reason="plays a root agent against nobody: needs root and setpriv"),
]

# The attacker's job, as nobody: it polls the Kineto endpoint as libkineto would, and
# plants PLANT at the trace path of the first request it gets ("none": it never polls).
ATTACKER = """
import os, socket, struct, sys, time
endpoint, home, plant = sys.argv[1], sys.argv[2], sys.argv[3]
def poll():
    pids = [os.getpid(), os.getppid()]
    payload = struct.pack("<iiq", 3, len(pids), 0) + struct.pack(f"<{len(pids)}i", *pids)
    return struct.pack("<Q32s", len(payload), b"req") + payload
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(f"{home}/poller-{os.getpid()}")
s.settimeout(0.3)
planted = False
while True:
    if plant != "none":
        s.sendto(poll(), endpoint)
    try:
        reply = s.recv(65536)
    except (socket.timeout, OSError):
        continue
    text = reply[40:].decode()
    if planted or "ACTIVITIES_LOG_FILE=" not in text:
        time.sleep(0.2)
        continue
    log_file = text.split("ACTIVITIES_LOG_FILE=", 1)[1].split("\\n", 1)[0]
    stem, _, ext = log_file.rpartition(".")
    path = f"{stem}_{os.getpid()}.{ext}"
    if plant == "sparse":
        with open(path, "wb") as fh:
            fh.truncate(1536 * 1024 * 1024)
    elif plant == "empties":
        with open(path, "wb") as fh:
            fh.write(b"[" + b"{}," * (4 * 1024 * 1024) + b"{}]")
    elif plant == "fifo":
        os.mkfifo(path)
    elif plant == "big_gzip":  # a gzip's magic and 3 MiB that no compressor shrinks
        with open(path, "wb") as fh:
            fh.write(b"\\x1f\\x8b" + os.urandom(3 * 1024 * 1024))
    elif plant == "big_json":  # a plain trace of 4.6 MB whose names compress to about half
        names = ",".join('{"ph": "X", "name": "%s", "ts": 1, "dur": 1}' % os.urandom(24).hex() for _ in range(50000))
        with open(path, "w") as fh:
            fh.write('{"traceEvents": [' + names + ']}')
    # "silent": polls, is asked, and never writes a trace
    planted = True
    print("planted", path, flush=True)
"""


class Node:
    """A root watch agent and the jobs beside it."""

    def __init__(self, tmp: Path, shared: Path, incidents: dict[str, object]) -> None:
        self.tmp, self.shared, self.tok = tmp, shared, token()
        self.capture_timeout = float(incidents.pop("capture_timeout", CAPTURE_TIMEOUT))
        self.sockets = shared / "sockets"
        self.config = tmp / "agent.toml"
        extra = "".join(f"{k} = {v}\n" for k, v in incidents.items())
        self.config.write_text(textwrap.dedent(f"""\
            interval = 0.3
            state_dir = '{tmp / "state"}'
            [gpu]
            backend = "off"
            [stacks]
            enabled = false
            [watch]
            cmdline_regex = ""
            env_markers = ["PAW_TOKEN={self.tok}"]
            gpu_processes = false
            scan_interval = 0.3
            [ondemand]
            socket_dir = '{self.sockets}'
            control_socket = '{tmp / "c.sock"}'
            trace_dir = '{shared / "ondemand"}'
            [traces]
            max_file_bytes = {MAX_TRACE_BYTES}
            [incidents]
            dir = '{tmp / "incidents"}'
            capture_timeout = {self.capture_timeout}
            rate_limit_seconds = 0
            """) + extra)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.agent = AgentProcess(["watch", "--listen", f"127.0.0.1:{self.port}", "--config", str(self.config)], tmp)
        self.agent.wait_healthy(self.url, timeout=60)
        self.jobs: list[subprocess.Popen] = []
        self.peak_rss = 0
        self.rss_cap = 1 << 62  # until sample_rss() starts
        self._sampling = threading.Event()

    def job(self, job_id: str, plant: str | None = None) -> subprocess.Popen:
        """A job of nobody's that plants ``plant`` (None: a job of root's that only sleeps)."""
        env = {"PATH": "/usr/bin:/bin", "PAW_TOKEN": self.tok, "SLURM_JOB_ID": job_id, "RANK": "0", "WORLD_SIZE": "1"}
        if plant is None:
            cmd = [sys.executable, "-c", "import time\nwhile True:\n    time.sleep(0.05)\n"]
        else:
            cmd = [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "/usr/bin/python3",
                   str(self.shared / "attacker.py"), str(self.sockets / "dynolog"), str(self.shared / "home"), plant]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                start_new_session=True)
        self.jobs.append(proc)
        wait_for(lambda: job_id in self.live_jobs(), 60, interval=0.3, what=f"job {job_id} watched")
        return proc

    def live_jobs(self) -> set[str]:
        up = parse_metrics(http_get(self.url + "/metrics")).get("profagent_target_up", [])
        return {lab["job_id"] for lab, v in up if v == 1}

    def capture(self, job_id: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "profagent", "incidents", "capture", "--config", str(self.config),
                               "--job", job_id, "--wait", "0"], capture_output=True, text=True, timeout=60)

    def incidents(self) -> list[dict]:
        return json.loads(http_get(self.url + "/api/incidents"))["incidents"]

    def incident(self, job_id: str) -> dict | None:
        mine = [i for i in self.incidents() if i["job_id"] == job_id]
        return mine[-1] if mine else None

    def wait_complete(self, job_id: str) -> dict:
        """The job's incident, once complete: it was written within capture_timeout (and a
        second or two to write the files) of its start, by its own clock."""
        done = wait_for(lambda: (i := self.incident(job_id)) and i["status"] == "complete" and i,
                        self.capture_timeout + 60, interval=0.2, what=f"the capture of {job_id} complete")
        assert self.peak_rss < self.rss_cap, (self.rss_cap, self.peak_rss)
        meta = json.loads((Path(done["path"]) / "incident.json").read_text())
        assert meta["completed"] - meta["time"] < self.capture_timeout + 3, meta
        return done

    def sample_rss(self) -> None:
        """Sample the agent's RSS from now on: it must stay under its idle RSS + RSS_HEADROOM."""
        proc = psutil.Process(self.agent.proc.pid)
        self.rss_cap = proc.memory_info().rss + RSS_HEADROOM

        def run() -> None:
            while not self._sampling.is_set():
                try:
                    self.peak_rss = max(self.peak_rss, proc.memory_info().rss)
                except psutil.Error:
                    return
                time.sleep(0.02)

        threading.Thread(target=run, daemon=True).start()

    def rejected(self, reason: str) -> float:
        """profagent_incidents_traces_rejected_total{reason}, once the next tick has published it."""
        def count() -> float:
            rows = parse_metrics(http_get(self.url + "/metrics")).get("profagent_incidents_traces_rejected_total", [])
            return sum(v for lab, v in rows if lab["reason"] == reason)

        wait_for(count, 10, interval=0.2, what=f"a {reason} rejection counted")
        return count()

    def close(self) -> None:
        self._sampling.set()
        for job in self.jobs:
            kill_tree(job)
        self.agent.stop()


@pytest.fixture
def node(tmp_path: Path) -> Iterator:
    shared = Path(tempfile.mkdtemp(prefix="pa-inc-"))  # where nobody can reach: not under tmp_path (0700)
    shared.chmod(0o755)
    (shared / "home").mkdir(mode=0o1777)
    (shared / "home").chmod(0o1777)
    (shared / "attacker.py").write_text(ATTACKER)
    (shared / "attacker.py").chmod(0o644)
    nodes: list[Node] = []

    def start(**incidents: object) -> Node:
        n = Node(tmp_path, shared, incidents)
        nodes.append(n)
        return n

    yield start
    for n in nodes:
        n.close()
    shutil.rmtree(shared, ignore_errors=True)


def _planted(job: subprocess.Popen) -> str:
    line = job.stdout.readline()  # the attacker says where, once it has planted
    assert line.startswith("planted "), line
    return line.split(" ", 1)[1].strip()


@pytest.mark.parametrize("plant, reason", [("sparse", "too_large"), ("empties", "not_a_trace")])
def test_a_planted_trace_cannot_blow_up_the_agent(node, plant: str, reason: str) -> None:
    """Item 6: a 1.5 GB sparse file (over traces.max_file_bytes: refused by its size, never
    read), or 12 MB of "[{},{},...]" (under it: 4 million dicts if parsed, about 400 MB)."""
    n = node()
    attacker = n.job("attack", plant)
    n.sample_rss()
    res = n.capture("attack")
    assert res.returncode == 0, res.stderr
    path = _planted(attacker)
    incident = n.wait_complete("attack")  # within capture_timeout, the agent's RSS within its cap
    summary = http_get(n.url + f"/api/incidents?id={incident['id']}")
    assert f"refused ({reason}" in summary, summary
    assert n.rejected(reason) == 1
    assert os.stat(path).st_uid == NOBODY  # the attacker's file is left as it was
    assert not [f for f in json.loads(summary)["files"] if f["name"].startswith("trace-rank")]


def test_a_fifo_or_a_silent_job_cannot_hold_captures_node_wide(node) -> None:
    """Item 7: a FIFO at the trace path does not hold the capture past its timeout; while
    another of nobody's captures waits for a trace that never comes, root's job is
    captured at once (one slot per job, one per user), and nobody's second job waits."""
    n = node(capture_timeout=20)
    fifo_job = n.job("attack-fifo", "fifo")
    silent_job = n.job("attack-silent", "silent")
    n.job("attack-other", "none")
    n.job("victim")
    n.sample_rss()

    assert n.capture("attack-fifo").returncode == 0
    path = _planted(fifo_job)
    n.wait_complete("attack-fifo")
    assert n.rejected("not_regular") == 1
    assert Path(path).is_fifo()

    assert n.capture("attack-silent").returncode == 0  # waits capture_timeout for its trace
    _planted(silent_job)  # asked, and it will never write
    busy = n.capture("attack-other")  # the same user: its one slot is taken
    assert busy.returncode == 2 and "busy" in busy.stderr, busy.stderr
    victim = n.capture("victim")  # another user: never blocked by nobody's capture
    assert victim.returncode == 0, victim.stderr
    assert n.incident("attack-silent")["status"] == "capturing"
    n.wait_complete("victim")
    silent = n.wait_complete("attack-silent")
    detail = json.loads(http_get(n.url + f"/api/incidents?id={silent['id']}"))
    assert "no on-demand trace from rank 0 (PID" in detail["summary"] and "within 20 s" in detail["summary"]
    # it polls free to trace and writes nothing: sent again, as to a job libkineto dropped it in, but only 3 more times
    assert "it was sent the config 4 times" in detail["summary"], detail["summary"]


def test_nobody_cannot_evict_roots_bundle(node) -> None:
    """Item 10: five stalled jobs of nobody's, with distinct SLURM_JOB_IDs, capture over and
    over; root's bundle of the victim's job stays, nobody keeps only its own newest."""
    n = node(max_count=6, max_count_per_job=1, max_count_per_user=3)
    n.job("victim")
    attackers = [f"attack{i}" for i in range(5)]
    for job_id in attackers:
        n.job(job_id, "none")
    assert n.capture("victim").returncode == 0
    victim = n.wait_complete("victim")
    for _ in range(2):
        for job_id in attackers:
            res = wait_for(lambda j=job_id: (r := n.capture(j)).returncode == 0 and r, 60, interval=0.5,
                           what=f"a capture of {job_id} accepted")  # one of nobody's at a time
            assert "incident" in res.stdout
            n.wait_complete(job_id)
    time.sleep(0.5)  # pruning runs as each capture ends: look after the last one has
    wait_for(lambda: sum(i["job_id"].startswith("attack") for i in n.incidents()) == 3, 10,
             what="nobody's bundles pruned to its own cap")
    kept = n.incidents()
    assert victim["id"] in [i["id"] for i in kept]
    assert (Path(victim["path"]) / "summary.md").exists()
    assert sorted(i["job_id"] for i in kept if i["job_id"] != "victim") == ["attack2", "attack3", "attack4"]


@pytest.mark.parametrize("plant", ["big_gzip", "big_json"])
def test_a_trace_larger_than_the_users_bundle_cap_is_left_out_and_said(node, plant: str) -> None:
    """Issue 41 item 11: a 1.57 GB trace was copied into a bundle against a 192 MiB per-user
    cap. Here the cap is 1 MiB: nobody's 3 MiB gzip is refused by its size before a byte is
    copied, its 4.6 MB plain trace once its compressed copy passes the room left; the
    bundle stays within the cap, and its notes say what was left out and why."""
    cap = 1024 * 1024
    n = node(max_bytes_per_user=cap)
    attacker = n.job("attack", plant)
    assert n.capture("attack").returncode == 0
    path = _planted(attacker)
    incident = n.wait_complete("attack")
    detail = json.loads(http_get(n.url + f"/api/incidents?id={incident['id']}"))
    assert "refused (over_bundle_cap:" in detail["summary"], detail["summary"]
    assert f"incidents.max_bytes_per_user ({cap})" in detail["summary"]
    assert n.rejected("over_bundle_cap") == 1
    folder = Path(incident["path"])
    size = sum(f.stat().st_size for f in folder.iterdir())
    assert size < cap, sorted((f.name, f.stat().st_size) for f in folder.iterdir())
    assert not [f for f in folder.iterdir() if f.name.startswith(("trace-rank", ".trace-rank"))]
    assert os.stat(path).st_size > cap  # what was planted really was over the cap

"""The fourth attacker round (issue 51): bundles, a squatted Kineto endpoint, floods and
discovery, against a root agent. Real processes, real py-spy, real sockets."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers.agent import free_port, http_get, parse_metrics
from helpers.nobody import nobody_python
from helpers.processes import kill_tree, wait_for
from helpers.watch import job_env, token, watch_config
from profagent.analysis.incidents import Trigger
from profagent.config import IncidentsConfig
from profagent.contracts import ProcessTree
from profagent.engine.incidents.bundle import META, SUMMARY, BundleMeta
from profagent.engine.incidents.capture import Capture
from profagent.engine.incidents.trigger import IncidentsSource
from profagent.sources.stacks import pyspy
from profagent.state import State
from profagent.target.pid import PidTarget

# 600 frames of a function named with 4,000 characters: a py-spy text dump of about 2.5 MB
DEEP = """
import sys, time
sys.setrecursionlimit(10000)
name = "f" * 4000
exec(f"def {name}(n):\\n    if n:\\n        return {name}(n - 1)\\n    while True:\\n        time.sleep(0.05)\\n")
print("deep", flush=True)
globals()[name](600)
"""
SLEEPER = "import time\nwhile True:\n    time.sleep(0.05)\n"


def _pyspy() -> str:
    try:
        return pyspy.find_pyspy()
    except pyspy.PySpyProblem as exc:
        pytest.fail(f"py-spy is a test dependency: {exc}")


def test_a_bundle_of_two_processes_claiming_one_rank_is_complete_escaped_and_capped(children, tmp_path: Path) -> None:
    """Issue 51 high 3, medium "bundles are not capped", low 3: two processes of one job
    both claim rank 0 (one runs a script whose file name holds ESC sequences, 600 frames
    deep with 4,000-character names), the job id holds ESC too. Bound: the capture
    completes (it crashed on FileExistsError: stacks-rank0.txt), each process has its
    stacks file, no file of the bundle holds a raw ESC byte (as `incidents show` prints:
    ``\\x1b``), and the deep dump is kept to pyspy.MAX_DUMP_TEXT with a line saying how
    much more py-spy printed."""
    folder = tmp_path / "src"
    folder.mkdir()
    script = folder / "job\x1b]0;pwned\x07\x1b[2J.py"
    script.write_text(DEEP)
    env = {"RANK": "0", "WORLD_SIZE": "1", "PATH": "/usr/bin:/bin"}
    deep = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    children.procs.append(deep)
    assert deep.stdout is not None and deep.stdout.readline().strip() == "deep"
    other = children.python(SLEEPER, env=env)
    job = "job\x1b[31m-51"
    trees = [wait_for(lambda p=p: (t := PidTarget(p.pid).refresh()) and t.mains() and t, 30, what="a tree")
             for p in (deep, other)]
    procs = tuple(dataclasses.replace(p, job_id=job) for t in trees for p in t.processes)
    tree = ProcessTree(job, deep.pid, procs, alive=True)
    assert [p.rank for p in tree.mains()] == ["0", "0"]
    source = IncidentsSource(IncidentsConfig(capture_timeout=60), tmp_path / "incidents", State())
    source.start()
    try:
        wait_for(lambda: "Thread" in source.run_dump(pyspy.dump_text_args(_pyspy(), other.pid, "nonblocking"))[0],
                 30, what="the interpreters readable")
        capture = Capture(source, Trigger("manual", job, None, "test \x1b[2J"), tree,
                          source.store.create("manual", job, time.time()), time.time(), 0)
        capture.run()
    finally:
        source.stop()
    meta = BundleMeta.from_json(json.loads((capture.folder / META).read_text()))
    assert meta is not None and meta.status == "complete"
    names = set(meta.files or ())
    stacks = sorted(n for n in names if n.startswith("stacks-rank0"))
    assert len(stacks) == 2 and "stacks-rank0.txt" in stacks and SUMMARY in names, names
    assert set(stacks) - {"stacks-rank0.txt"} <= {f"stacks-rank0-pid{deep.pid}.txt", f"stacks-rank0-pid{other.pid}.txt"}
    for path in capture.folder.iterdir():
        assert b"\x1b" not in path.read_bytes(), path.name
    assert "job\\x1b[31m-51" in (capture.folder / SUMMARY).read_text()
    texts = {n: (capture.folder / n).read_text() for n in stacks}
    [text] = [t for t in texts.values() if "pwned" in t]
    print(f"deep dump kept: {len(text)} characters; {text.splitlines()[-1]}")
    assert "job\\x1b]0;pwned\\x07\\x1b[2J.py" in text
    assert len(text.encode()) <= pyspy.MAX_DUMP_TEXT + 4096
    assert "(truncated: py-spy printed" in text.splitlines()[-1]
    assert any("<module>" in t and "pwned" not in t for t in texts.values())


def test_communicate_capped_reads_past_the_cap_and_keeps_whole_lines() -> None:
    """py-spy never blocks on a full pipe: what is over the cap is read and dropped."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys\nfor i in range(200000): print('x' * 99)\n"
                             "print('err', file=sys.stderr)"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    got = pyspy.communicate_capped(proc, 60, max_out=1 << 20)
    assert proc.returncode == 0
    assert got.out.endswith("\n") and set(got.out) == {"x", "\n"} and len(got.out) <= 1 << 20
    assert len(got.out) + got.truncated == 200000 * 100 and got.err == "err\n"


SLEEPING_RANK = "import time\nwhile True:\n    sum(range(3000))\n    time.sleep(0.02)\n"


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="plays a root agent against nobody")
def test_nobody_cannot_join_roots_job_through_a_root_agent_by_naming_its_label(run_agent, children, tmp_path: Path) -> None:
    """Issue 51 high 3, end to end: nobody sets TORCHELASTIC_RUN_ID=victim-job first, so
    root's torchrun-like job with that id is labelled victim-job@root; then nobody starts
    processes with TORCHELASTIC_RUN_ID=victim-job@root and RANK 0 and 1 (one of them stopped,
    as the frozen fake rank was). Bound, on every scrape over 5 s: the series of job
    victim-job@root carry root's two PIDs and user root only (no duplicated series); nobody's
    processes are victim-job@root@nobody; and no finding of root's job exists, nor a
    duplicate_rank."""
    tok = token()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent = run_agent(["watch", "--config", str(watch_config(tmp_path, tok)), "--listen", f"127.0.0.1:{port}"])
    agent.wait_healthy(url, timeout=30)
    folder = Path(tempfile.mkdtemp(prefix="paw-round4-"))
    folder.chmod(0o755)
    attackers = []
    try:
        attackers.append(nobody_python(SLEEPING_RANK, job_env(tok, TORCHELASTIC_RUN_ID="victim-job", RANK="0"), folder))

        def info() -> list[dict[str, str]]:
            return [lab for lab, _ in parse_metrics(http_get(url + "/metrics")).get("profagent_target_info", [])]

        wait_for(lambda: any(lab.get("job_id") == "victim-job" for lab in info()), 30, what="nobody's claim")
        mine = [children.python(SLEEPING_RANK, env=job_env(tok, TORCHELASTIC_RUN_ID="victim-job", RANK=str(r),
                                                         WORLD_SIZE="2")) for r in (0, 1)]
        for r in (0, 1):
            attackers.append(nobody_python(SLEEPING_RANK, job_env(tok, TORCHELASTIC_RUN_ID="victim-job@root",
                                                                  RANK=str(r), WORLD_SIZE="2"), folder))
        os.kill(attackers[-1].pid, signal.SIGSTOP)  # a frozen "rank"
        wait_for(lambda: len({lab["pid"] for lab in info() if lab.get("job_id", "").startswith("victim-job@root")}) == 4,
                 30, what="every process watched")
        began = time.monotonic()
        while time.monotonic() - began < 5:
            parsed = parse_metrics(http_get(url + "/metrics"))
            rows = [lab for lab, _ in parsed.get("profagent_target_info", [])]
            victim = [lab for lab in rows if lab.get("job_id") == "victim-job@root"]
            assert sorted(int(lab["pid"]) for lab in victim) == sorted(p.pid for p in mine), victim
            assert {lab["user"] for lab in victim} == {"root"}
            forged = [lab for lab in rows if lab.get("job_id") == "victim-job@root@nobody"]
            assert sorted(int(lab["pid"]) for lab in forged) == sorted(p.pid for p in attackers[1:])
            assert {lab["user"] for lab in forged} == {"nobody"}
            cpu = [lab for lab, _ in parsed.get("profagent_process_cpu_seconds_total", [])
                   if lab.get("job_id") == "victim-job@root"]
            assert len(cpu) == len({tuple(sorted(lab.items())) for lab in cpu})  # no duplicated series
            findings = json.loads(http_get(url + "/api/findings"))["findings"]
            assert not [f for f in findings if f["job_id"] == "victim-job@root"], findings
            time.sleep(0.5)
    finally:
        for proc in attackers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            kill_tree(proc)
        shutil.rmtree(folder, ignore_errors=True)

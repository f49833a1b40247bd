"""The fourth attacker round on the timeline's probes (issue 51, High 1 and 2): ``nobody``
maps files named libtorch_cpu.so into a watched job of its own. Eight that are no library
and ten small ELF files that the agent does probe: before, each took one of the node's
eight slots for good, and root's job started afterwards was never probed; now slots are
per user and freed when no process maps the file, and a file that gives no probe costs
none. And 1 MiB whose string table repeats a probed name with no NUL, while root's job
steps: before, the agent held gigabytes and every job's timeline froze. Each time root's
torchrun job is counted exactly against its own log, and every definition of the agent
is gone from uprobe_events once it has stopped."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers.agent import free_port, http_get, parse_metrics
from helpers.fake_libtorch import junk, probeable, repeated_name
from helpers.nobody import nobody_python, nobody_with_torch
from helpers.processes import kill_tree, wait_for
from helpers.timeline import Job
from helpers.watch import job_env, samples, token, watch_config
from profagent.system import uprobes

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                       reason="plays a root agent against nobody with kernel probes: needs root and setpriv"),
]

TRACEFS = (uprobes.find_tracefs(mount_if_missing=True) if os.geteuid() == 0 else None) or Path("/sys/kernel/tracing")
JUNK, PROBEABLE = 8, 10

MAPPER = """
import mmap, os, time
maps = []
for path in os.environ["LIBS"].split(":"):
    with open(path, "rb") as fh:
        maps.append(mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ | mmap.PROT_EXEC, flags=mmap.MAP_PRIVATE))
open(os.environ["READY"], "w").write("mapped")
while True:
    time.sleep(0.1)
"""


def stops_leaving_none_of_its_groups(agent, before: set[str]) -> None:  # noqa: ANN001  (an AgentProcess)
    """SIGTERM: the agent exits 0 and none of its probe groups (named by its pid; other agents
    probe too) is left."""
    mine = {g for g in _groups() - before if f"_{agent.proc.pid:x}_" in g}
    assert mine
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(30) == 0
    assert not mine & _groups(), "a definition of the agent is left after its clean stop"


def _groups() -> set[str]:
    return {g for g, _ in uprobes.definitions(TRACEFS)}


def test_nobodys_libraries_never_shut_out_roots_job(tmp_path: Path, run_agent) -> None:
    base = Path(tempfile.mkdtemp(prefix="paw-slots-"))
    attacker: subprocess.Popen | None = None
    job: Job | None = None
    try:
        base.chmod(0o777)
        paths = []
        # mapped in this order, the junk lies lowest: first in /proc/PID/maps, first read
        for i in range(PROBEABLE + JUNK):
            folder = base / f"lib{i}"
            folder.mkdir(mode=0o755)
            path = folder / "libtorch_cpu.so"
            path.write_bytes(probeable(i) if i < PROBEABLE else junk(i))
            path.chmod(0o644)
            paths.append(path)
        tok = token()
        ready = base / "ready"
        attacker = nobody_python(MAPPER, {**job_env(tok, SLURM_JOB_ID="atk-51", RANK="0", LOCAL_RANK="0",
                                                    WORLD_SIZE="1"),
                                          "LIBS": ":".join(map(str, paths)), "READY": str(ready)}, base)
        wait_for(ready.exists, 30, interval=0.2, what="nobody's files mapped")
        before = _groups()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        agent = run_agent(["watch", "--config", str(watch_config(tmp_path, tok)), "--listen", f"127.0.0.1:{port}"])
        agent.wait_healthy(url, timeout=30)

        def lines(pattern: str) -> list[str]:
            return [ln for ln in agent.output.splitlines() if re.search(pattern, ln)]

        # nobody's eight slots filled with probeable files, although junk was read first:
        # a file that gives no probe costs no slot
        junk_line = r"timeline: .*/lib(\d+)/libtorch_cpu\.so of PID \d+: .*not probed"
        wait_for(lambda: len(lines(r"timeline: probing .*/lib\d+/libtorch_cpu\.so \(2 probes\)")) >= 8, 60,
                 interval=0.5, what="nobody's eight slots filled")
        assert lines(junk_line), "no junk file was read"
        wait_for(lambda: lines(r"uid 65534 has 8 libraries probed or waiting"), 30, interval=0.5,
                 what="the line saying nobody's slots are full")

        # root's job, started afterwards: probed, and every step counted
        job = Job(tmp_path, 2, "--steps", "60", "--linger", "120", env=job_env(tok))
        wait_for(lambda: lines(r"timeline: probing .*site-packages/torch/lib/libtorch_cpu\.so \(\d+ probes\)"), 120,
                 interval=0.5, what="root's libtorch probed")

        def roots_ranks() -> dict[str, float]:
            m = parse_metrics(http_get(url + "/metrics"))
            return {lab["rank"]: v for lab, v in samples(m, "profagent_optimizer_steps_total")
                    if lab.get("job_id") != "atk-51"}

        wait_for(lambda: set(roots_ranks()) == {"0", "1"}, 60, interval=0.5, what="root's two ranks seen")
        job.start_file.write_text("go")
        wait_for(job.done, 180, interval=0.5, what="root's job's steps")
        truth = [float(len(job.truth(r)["calls"])) for r in range(2)]
        wait_for(lambda: [roots_ranks().get(str(r)) for r in range(2)] == truth, 30, interval=0.5,
                 what=f"the agent's counts of root's steps to reach its log's {truth}")
        assert len(lines(r"timeline: probing .*/lib\d+/libtorch_cpu\.so")) == 8  # nobody got no more
        read = [re.search(junk_line, ln).group(1) for ln in lines(junk_line)]  # type: ignore[union-attr]
        assert len(read) == len(set(read)) <= JUNK, read  # each junk file read once, not at every look

        # nobody leaves: its probes are removed, its slots freed
        kill_tree(attacker)
        wait_for(lambda: len(lines(r"is no longer mapped by an observed process: its 2 probes removed")) == 8, 60,
                 interval=0.5, what="nobody's probes removed once its process is gone")
        stops_leaving_none_of_its_groups(agent, before)
    finally:
        if attacker is not None:
            kill_tree(attacker)
        if job is not None:
            job.stop()
        shutil.rmtree(base, ignore_errors=True)


def _rss_peak_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmHWM:"))


def test_nobodys_crafted_string_table_neither_bloats_the_agent_nor_stalls_roots_job(tmp_path: Path,
                                                                                   run_agent) -> None:
    base = Path(tempfile.mkdtemp(prefix="paw-strtab-"))
    attacker: subprocess.Popen | None = None
    job: Job | None = None
    try:
        base.chmod(0o777)  # nobody writes its ready file there
        crafted = base / "crafted" / "libtorch_cpu.so"
        crafted.parent.mkdir(mode=0o755)
        crafted.write_bytes(repeated_name(1 << 20, nul=False))
        crafted.chmod(0o644)
        tok = token()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        agent = run_agent(["watch", "--config", str(watch_config(tmp_path, tok)), "--listen", f"127.0.0.1:{port}"])
        agent.wait_healthy(url, timeout=30)
        before = _groups()
        job = Job(tmp_path, 2, "--seconds", "40", "--linger", "120", env=job_env(tok))

        def roots_steps() -> list[float | None]:
            m = parse_metrics(http_get(url + "/metrics"))
            got = {lab["rank"]: v for lab, v in samples(m, "profagent_optimizer_steps_total")
                   if lab.get("job_id") != "atk-51b"}
            return [got.get(str(r)) for r in range(2)]

        wait_for(lambda: "site-packages/torch/lib/libtorch_cpu.so (" in agent.output, 120, interval=0.5,
                 what="root's libtorch probed")
        wait_for(lambda: None not in roots_steps(), 60, interval=0.5, what="root's ranks seen")
        job.start_file.write_text("go")
        wait_for(lambda: (roots_steps()[0] or 0) > 10, 60, interval=0.5, what="root's job stepping")
        rss_before = _rss_peak_mib(agent.proc.pid)
        ready = base / "ready"
        attacker = nobody_python(MAPPER, {**job_env(tok, SLURM_JOB_ID="atk-51b", RANK="0", LOCAL_RANK="0",
                                                    WORLD_SIZE="1"),
                                          "LIBS": str(crafted), "READY": str(ready)}, base)
        wait_for(ready.exists, 30, interval=0.2, what="nobody's file mapped")
        # read within moments (it was 25 s of CPU and 3.2 GB for 0.5 MiB), and refused: the
        # names run past what a torch name may be
        wait_for(lambda: re.search(r"crafted/libtorch_cpu\.so", agent.output), 30, interval=0.5,
                 what="the crafted file read")
        # root's figures kept moving meanwhile: steps counted in every 2 s stretch
        seen = [roots_steps()[0] or 0.0]
        for _ in range(4):
            wait_for(lambda: (roots_steps()[0] or 0) > seen[-1], 5, interval=0.2, what="root's steps still counted")
            seen.append(roots_steps()[0] or 0.0)
        grown = _rss_peak_mib(agent.proc.pid) - rss_before
        print(f"agent's peak RSS grew {grown:.1f} MiB reading nobody's 1 MiB file")
        assert grown < 64, grown
        wait_for(job.done, 180, interval=0.5, what="root's job's steps")
        truth = [float(len(job.truth(r)["calls"])) for r in range(2)]
        last: list[object] = []

        def exact() -> bool:
            m = parse_metrics(http_get(url + "/metrics"))
            last[:] = [roots_steps(), samples(m, "profagent_timeline_lost_events_total"),
                       samples(m, "profagent_timeline_events_total")]
            return last[0] == truth

        try:
            wait_for(exact, 30, interval=0.5, what=f"the agent's counts of root's steps to reach its log's {truth}")
        except BaseException:
            print("counted, lost, events:", last)
            raise
        stops_leaving_none_of_its_groups(agent, before)
    finally:
        if attacker is not None:
            kill_tree(attacker)
        if job is not None:
            job.stop()
        shutil.rmtree(base, ignore_errors=True)


FLOOD = """
import torch
while True:
    with torch.autograd.profiler.record_function("flood"):
        pass
"""


def test_events_lost_to_nobodys_flood_are_said_for_roots_rank(tmp_path: Path, run_agent) -> None:
    """Issue 51, Medium: two processes of nobody, not watched, run `record_function` flat
    out on the same libtorch file as root's job, into rings of one page: events are lost.
    Root's rank says so (its series, `diagnose`, one log line) and its step count is a
    floor of its log's, never above it."""
    tok = token()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    folder = Path(tempfile.mkdtemp(prefix="paw-flood-"))
    floods: list[subprocess.Popen] = []
    job: Job | None = None
    try:
        folder.chmod(0o755)
        agent = run_agent(["watch", "--config", str(watch_config(tmp_path, tok)), "--listen", f"127.0.0.1:{port}"],
                          env={"PROFAGENT_TIMELINE_RING_PAGES": "1"})
        agent.wait_healthy(url, timeout=30)
        job = Job(tmp_path, 1, "--seconds", "15", "--linger", "120", env=job_env(tok))
        wait_for(lambda: "site-packages/torch/lib/libtorch_cpu.so (" in agent.output, 120, interval=0.5,
                 what="root's libtorch probed")
        script = folder / "flood.py"
        script.write_text(FLOOD)
        script.chmod(0o644)
        for k in range(2):
            (folder / str(k)).mkdir(mode=0o755)
            floods.append(subprocess.Popen(nobody_with_torch(script, folder / str(k)), cwd="/", start_new_session=True,
                                           env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}))
        job.start_file.write_text("go")
        wait_for(job.done, 180, interval=0.5, what="root's job's steps")
        calls = len(job.truth(0)["calls"])

        def lost() -> float:
            m = parse_metrics(http_get(url + "/metrics"))
            return sum(v for lab, v in samples(m, "profagent_timeline_lost_events_total") if lab.get("rank") == "0")

        wait_for(lambda: lost() > 0, 30, interval=0.5, what="root's rank's lost events")
        m = parse_metrics(http_get(url + "/metrics"))
        counted = next(v for _, v in samples(m, "profagent_optimizer_steps_total", rank="0"))
        assert counted <= calls, (counted, calls)  # a floor
        assert re.search(r"timeline: job \S+ rank 0: \d+ probe events lost where it ran", agent.output)
        out = subprocess.run([sys.executable, "-m", "profagent", "diagnose", "--url", url], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "COLUMNS": "250"})
        assert re.search(r"rank 0: p50 .*misses events \(\d+ lost: figures approximate, counts a floor\)",
                         out.stdout), out.stdout
        print(f"root's rank: {calls} steps in its log, {counted:.0f} counted, {lost():.0f} events lost where it ran")
    finally:
        for proc in floods:
            kill_tree(proc)
        if job is not None:
            job.stop()
        shutil.rmtree(folder, ignore_errors=True)

"""The third attacker round (issue 41): a root `profagent watch` against `nobody` running a
watched job of its own, beside another user's job that must keep being served."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.agent import free_port, http_get, parse_metrics
from helpers.flood import NOBODY_PYTHON, Flood
from helpers.nobody import as_nobody, nobody_python
from helpers.processes import kill_tree, pyspy_processes, wait_for
from helpers.watch import job_env, samples, token, watch_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                       reason="plays a root agent against nobody: needs root and setpriv"),
]

# nobody maps a file named like libpython (executable, as py-spy looks for it), unlinks it,
# and plants "<path> (deleted)": a FIFO (py-spy, run by root, blocked forever opening it)
# or a symlink to a file only root may read (root's py-spy opened /etc/shadow).
PLANTER = """
import mmap, os, time
path = os.path.join({folder!r}, "libpython3.11.so.1.0")
with open(path, "wb") as fh:
    fh.write(bytes(4096))
fd = os.open(path, os.O_RDONLY)
mapped = mmap.mmap(fd, 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_EXEC)
os.unlink(path)
planted = path + " (deleted)"
os.mkfifo(planted) if {plant!r} == "fifo" else os.symlink("/etc/shadow", planted)
print("planted", flush=True)
while True:
    sum(range(3000))
    time.sleep(0.02)
"""
VICTIM = "import time\nwhile True:\n    sum(range(3000))\n    time.sleep(0.02)\n"


@pytest.fixture
def nobody_folder() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="paw-round3-"))
    base.chmod(0o755)
    for plant in ("fifo", "symlink"):
        (base / plant).mkdir()
        (base / plant).chmod(0o777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_planted_fifo_or_symlink_at_a_deleted_libpython_is_never_opened_and_others_stay_sampled(
        run_agent, children, tmp_path: Path, nobody_folder: Path) -> None:
    """Issue 41 item 1. Bound: no py-spy is ever started on nobody's two ranks (each is
    refused once, reason unsafe_target, one log line each), and the victim's job, started
    after them, gets samples that keep growing within 30 s."""
    tok = token()
    port = free_port()
    cfg = watch_config(tmp_path, tok)
    cfg.write_text(cfg.read_text().replace("[stacks]\nenabled = false", "[stacks]\nenabled = true\nwindow = 1"))
    attackers: list[subprocess.Popen] = []
    try:
        for rank, plant in enumerate(("fifo", "symlink")):
            code = PLANTER.format(folder=str(nobody_folder / plant), plant=plant)
            env = job_env(tok, SLURM_JOB_ID="atk-41", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
            attackers.append(nobody_python(code, env, nobody_folder))
        for plant in ("fifo", "symlink"):
            wait_for(lambda p=plant: os.path.lexists(nobody_folder / p / "libpython3.11.so.1.0 (deleted)"),
                     30, what=f"nobody's planted {plant}")
        agent = run_agent(["watch", "--config", str(cfg), "--listen", f"127.0.0.1:{port}"])
        url = f"http://127.0.0.1:{port}"
        agent.wait_healthy(url, timeout=30)
        attacker_pids = [p.pid for p in attackers]
        started_on_attacker: list[int] = []

        def look() -> dict:
            for pid in attacker_pids:
                started_on_attacker.extend(p.pid for p in pyspy_processes(of=agent.proc.pid, sampling=pid))
            return parse_metrics(http_get(url + "/metrics"))

        def refused() -> float:
            return sum(v for _, v in samples(look(), "profagent_stack_sampler_errors_total", job_id="atk-41",
                                              reason="unsafe_target"))

        wait_for(lambda: refused() >= 2, 60, interval=0.05, what="both of nobody's ranks refused")
        victim = children.python(VICTIM, env=job_env(tok, SLURM_JOB_ID="victim-41"))
        began = time.monotonic()

        def victim_samples() -> float:
            return sum(v for _, v in samples(look(), "profagent_stack_samples_total", job_id="victim-41"))

        first = wait_for(victim_samples, 60, interval=0.05, what="the victim's job sampled")
        wait_for(lambda: victim_samples() > first, 30, interval=0.05, what="the victim's samples growing")
        served_after = time.monotonic() - began
        for _ in range(20):  # and a while longer, looking often
            look()
            time.sleep(0.05)
        print(f"victim sampled and growing after {served_after:.1f} s; refusals {refused():.0f}")
        assert started_on_attacker == [], "a py-spy was started on a rank whose libpython is planted"
        assert victim.poll() is None and all(p.poll() is None for p in attackers)  # nobody's job unharmed
        assert refused() == 2  # each process refused once: skipped until it exits, not retried
        lines = [ln for ln in agent.output.splitlines() if "is a deleted file" in ln]
        assert len(lines) == 2, lines
        assert all("libpython3.11.so.1.0 (deleted)" in ln for ln in lines)
    finally:
        for proc in attackers:
            kill_tree(proc)


def _gzip_of_small_events(path: Path, events: int) -> None:
    """A .json.gz of ``events`` small valid complete events (a block of 10,000 deflated
    again and again: a few MB on disk, hundreds of MB inflated)."""
    one = b'{"ph":"X","cat":"cpu_op","name":"aten::add","pid":1,"tid":1,"ts":1,"dur":1}'
    block = b",".join([one] * 10_000)
    c = zlib.compressobj(1, zlib.DEFLATED, 31)
    with open(path, "wb") as fh:
        fh.write(c.compress(b'{"traceEvents": [' + block))
        for _ in range(events // 10_000 - 1):
            fh.write(c.compress(b"," + block))
        fh.write(c.compress(b"]}") + c.flush())


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_small_gzip_of_millions_of_small_events_is_refused_at_the_event_cap_with_bounded_memory(
        run_agent, tmp_path: Path) -> None:
    """Issue 41 item 2, at default caps: nobody, with a watched job of its own, drops a .json.gz
    of 3 M small valid events (the attack: 7 MB inflating to 2,000 MiB cost 4.5 GB and 48 s of
    CPU, and was ingested). Bound: refused as too_many_events (traces.max_events, 1 M) with
    the agent's peak RSS up by less than 256 MiB and less than 15 s of its CPU."""
    tok = token()
    port = free_port()
    folder = f"/tmp/paw-ondemand-{tok}"
    os.mkdir(folder)
    os.chmod(folder, 0o1777)
    cfg = watch_config(tmp_path, tok)
    # its own sockets: another agent on the machine may hold the default ones
    cfg.write_text(cfg.read_text() + f'\n[ondemand]\ntrace_dir = "{folder}"\nsocket_dir = "{tmp_path}"\n'
                                     f'control_socket = "{tmp_path / "control.sock"}"\n')
    flood = Flood(1, NOBODY_PYTHON, [NOBODY_PYTHON, "-c", VICTIM], env=job_env(tok))
    try:
        agent = run_agent(["watch", "--config", str(cfg), "--listen", f"127.0.0.1:{port}"])
        url = f"http://127.0.0.1:{port}"
        agent.wait_healthy(url, timeout=30)
        wait_for(lambda: any(v == 1 for _, v in parse_metrics(http_get(url + "/metrics")).get("profagent_target_up", [])),
                 timeout=30, what="nobody's job watched")
        bomb = tmp_path / "events.json.gz"
        _gzip_of_small_events(bomb, 3_000_000)
        assert bomb.stat().st_size < 8 * 2**20
        baseline, cpu_before = _peak_rss_mib(agent.proc.pid), _cpu_seconds(agent.proc.pid)
        target = f"{folder}/profagent_x_{flood.pids()[0]}.json.gz"
        with bomb.open("rb") as src:  # written by nobody itself
            subprocess.run(as_nobody("/bin/sh", "-c", 'cat > "$1"', "sh", target), stdin=src, check=True)

        def rejected() -> float:
            rows = parse_metrics(http_get(url + "/metrics")).get("profagent_traces_rejected_total", [])
            return sum(v for lab, v in rows if lab.get("reason") == "too_many_events")

        wait_for(lambda: rejected() >= 1, timeout=60, what="the trace counted as too_many_events")
        peak, cpu = _peak_rss_mib(agent.proc.pid), _cpu_seconds(agent.proc.pid) - cpu_before
        print(f"{bomb.stat().st_size / 2**20:.1f} MiB on disk; peak RSS {baseline:.0f} -> {peak:.0f} MiB; CPU {cpu:.1f} s")
        assert peak - baseline < 256, f"peak RSS {baseline:.0f} -> {peak:.0f} MiB"
        assert cpu < 15, f"{cpu:.1f} s of CPU"
        handled = parse_metrics(http_get(url + "/metrics")).get("profagent_traces_total", [])
        assert sum(v for lab, v in handled if lab.get("status") == "ingested") == 0
        assert sum(1 for line in agent.output.splitlines() if "traces.max_events" in line) == 1
    finally:
        flood.stop()
        shutil.rmtree(folder, ignore_errors=True)


# One rank recursing 600 deep through 4,000-character function and file names (the attack
# took the agent to 1.59 GB, peak 1.86 GB, still 1.57 GB after the job ended).
DEEP = """
import time
name = "f" * 4000
source = f"def {name}(n):\\n    if n == 0:\\n        while True:\\n            sum(range(3000)); time.sleep(0.02)\\n" \\
         f"    return {name}(n - 1)\\n"
space = {"time": time}
exec(compile(source, "/srv/" + "d" * 4000 + "/train.py", "exec"), space)
space[name](600)
"""


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_deep_stacks_of_long_names_cost_little_and_leave_with_the_job(
        run_agent, tmp_path: Path, nobody_folder: Path) -> None:
    """Issue 41 item 3. Bound: over 8 sampled windows of that rank the agent's peak RSS grows
    by less than 128 MiB; a sample's stack is cut to 200 frames (the rest one "… N frames"
    root frame) of 300-character names; once the job has left, RSS is back within 64 MiB of
    its level before the job."""
    tok = token()
    port = free_port()
    cfg = watch_config(tmp_path, tok)
    cfg.write_text(cfg.read_text().replace("[stacks]\nenabled = false", "[stacks]\nenabled = true\nwindow = 1"))
    agent = run_agent(["watch", "--config", str(cfg), "--listen", f"127.0.0.1:{port}"])
    url = f"http://127.0.0.1:{port}"
    agent.wait_healthy(url, timeout=30)
    before = _rss_mib(agent.proc.pid)
    baseline = _peak_rss_mib(agent.proc.pid)
    deep = nobody_python(DEEP, job_env(tok, SLURM_JOB_ID="deep-41"), nobody_folder)
    try:
        def windows() -> float:
            rows = samples(parse_metrics(http_get(url + "/metrics")), "profagent_stack_samples_total", job_id="deep-41")
            return sum(v for _, v in rows)

        first = wait_for(windows, 90, interval=0.2, what="the deep rank sampled")
        # stacks.rate is 20 samples a second, window 1 s: 120 more samples are 8 windows or more
        wait_for(lambda: windows() >= first + 8 * 15, 120, interval=0.2, what="8 more windows of the deep rank")
        peak = _peak_rss_mib(agent.proc.pid)
        stacks = http_get(url + "/api/stacks?job=deep-41")
    finally:
        kill_tree(deep)

    def job_gone() -> bool:
        rows = parse_metrics(http_get(url + "/metrics")).get("profagent_target_up", [])
        return not any(lab.get("job_id") == "deep-41" for lab, _ in rows)

    wait_for(job_gone, 60, what="the deep job forgotten")
    after = _rss_mib(agent.proc.pid)
    print(f"peak RSS {baseline:.0f} -> {peak:.0f} MiB; RSS {before:.0f} before the job, {after:.0f} after")
    assert peak - baseline < 128, f"peak RSS {baseline:.0f} -> {peak:.0f} MiB"
    assert after - before < 64, f"RSS {before:.0f} MiB before the job, {after:.0f} after it left"
    assert "f" * 301 not in stacks and "frames" in stacks


def test_a_job_id_claimed_first_with_another_users_name_does_not_take_that_users_label(
        run_agent, children, tmp_path: Path, nobody_folder: Path) -> None:
    """Issue 41 item 8: nobody starts first with SLURM_JOB_ID=<id> and SLURM_JOB_USER=root
    (the attack named alice); root's real job <id> starts after. Bound: within a few scans,
    root's job is the plain <id> with user="root", nobody's is <id>@nobody with
    user="nobody", and no series of nobody's carries root's name."""
    tok = token()
    port = free_port()
    job = f"12345{tok[:6]}"
    cfg = watch_config(tmp_path, tok)
    agent = run_agent(["watch", "--config", str(cfg), "--listen", f"127.0.0.1:{port}"])
    url = f"http://127.0.0.1:{port}"
    agent.wait_healthy(url, timeout=30)
    forger = nobody_python(VICTIM, job_env(tok, SLURM_JOB_ID=job, SLURM_JOB_USER="root"), nobody_folder)
    try:
        def info() -> list[dict[str, str]]:
            return [lab for lab, v in parse_metrics(http_get(url + "/metrics")).get("profagent_target_info", [])]

        first = wait_for(lambda: [lab for lab in info() if lab.get("job_id", "").startswith(job)], 30,
                         what="nobody's job watched")
        assert [(lab["job_id"], lab["user"]) for lab in first] == [(job, "nobody")]  # its owner, not its word
        began = time.monotonic()
        children.python(VICTIM, env=job_env(tok, SLURM_JOB_ID=job, SLURM_JOB_USER="root"))

        def both() -> list[tuple[str, str]]:
            rows = sorted({(lab["job_id"], lab["user"]) for lab in info() if lab.get("job_id", "").startswith(job)})
            return rows if len(rows) == 2 else []

        rows = wait_for(lambda: (r := both()) and (job, "root") in r and r, 30, what="root's job under its plain id")
        print(f"relabelled after {time.monotonic() - began:.1f} s: {rows}")
        assert rows == [(job, "root"), (f"{job}@nobody", "nobody")]
        assert not [lab for lab in info() if lab.get("job_id") == job and lab.get("user") != "root"]
    finally:
        kill_tree(forger)


def test_a_flood_of_look_alike_jobs_gets_ten_ignoring_lines_a_minute(tmp_path: Path) -> None:
    """Issue 41 item 10 (the attack: 821 "ignoring job" warnings in 50 s from 3,000
    look-alikes). nobody starts 40 processes, each its own job; the watch caps (4 jobs, 2
    per user) ignore 38 of them, each once. Bound: the log handler the CLI installs lets 10
    of those lines through per minute, though every one was looked at and ignored."""
    import io
    import logging

    from profagent.logs import PrintableFormatter, RateLimit
    from profagent.target.node import Limits, NodeTarget, Rules

    tok = token()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(PrintableFormatter("profagent %(levelname)s: %(message)s"))
    handler.addFilter(RateLimit())
    logger = logging.getLogger("profagent.target.node")
    logger.addHandler(handler)
    flood = Flood(40, NOBODY_PYTHON, [NOBODY_PYTHON, "-c", VICTIM], env=job_env(tok),
                  each=[{"SLURM_JOB_ID": f"lookalike-{i}"} for i in range(40)])
    try:
        target = NodeTarget(Rules(None, (("PAW_TOKEN", tok),), False),
                            Limits(scan_interval=0.0, max_jobs=4, max_jobs_per_user=2, max_new_per_scan=40),
                            settle_seconds=0.0, self_pid=-1)
        wait_for(lambda: target.refresh() and len(target._ignored) >= 38, 60, what="38 look-alike jobs ignored")
    finally:
        logger.removeHandler(handler)
        flood.stop()
    lines = [line for line in stream.getvalue().splitlines() if "ignoring job" in line]
    print(f"{len(target._ignored)} jobs ignored, {len(lines)} lines")
    assert len(lines) == 10, lines


def _inotify_watches(pid: int) -> int:
    """Inotify watches held by a process (one "inotify wd:" line per watch in its fdinfo)."""
    total = 0
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            with open(f"/proc/{pid}/fdinfo/{fd}") as fh:
                total += sum(1 for line in fh if line.startswith("inotify wd:"))
        except OSError:
            continue
    return total


def test_folders_made_in_the_ondemand_folder_cost_no_watch_and_delay_no_trace(
        run_agent, children, tmp_path: Path) -> None:
    """Issue 41 item 4 (the attack: 30,000 empty folders gave 30,001 root inotify watches, a
    thread at 45-100% of a core, and another user's traces not ingested within 200 s). nobody
    makes 3,000 folders, nested too, in the on-demand folder. Bound: the agent keeps 1
    inotify watch on it, and root's trace written there is ingested within 30 s."""
    import json

    from test_security_attribution import trace_of

    tok = token()
    port = free_port()
    folder = Path(f"/tmp/paw-ondemand-{tok}")
    folder.mkdir()
    folder.chmod(0o1777)
    cfg = watch_config(tmp_path, tok)
    # its own sockets: another agent on the machine may hold the default ones
    cfg.write_text(cfg.read_text() + f'\n[ondemand]\ntrace_dir = "{folder}"\nsocket_dir = "{tmp_path}"\n'
                                     f'control_socket = "{tmp_path / "control.sock"}"\n')
    try:
        agent = run_agent(["watch", "--config", str(cfg), "--listen", f"127.0.0.1:{port}"])
        url = f"http://127.0.0.1:{port}"
        agent.wait_healthy(url, timeout=30)
        watches_before = _inotify_watches(agent.proc.pid)
        made = subprocess.run(as_nobody(NOBODY_PYTHON, "-c", "import os, sys\n"
                                        "for i in range(3000):\n"
                                        "    os.makedirs(os.path.join(sys.argv[1], f'd{i}', 'sub'))\n", str(folder)),
                              capture_output=True, text=True, timeout=120)
        assert made.returncode == 0, made.stderr
        victim = children.python(VICTIM, env=job_env(tok, SLURM_JOB_ID="victim-41", RANK="0", WORLD_SIZE="1"))
        wait_for(lambda: any(lab.get("job_id") == "victim-41" for lab, v in
                             parse_metrics(http_get(url + "/metrics")).get("profagent_target_up", [])), 30,
                 what="the victim's job watched")
        # the traces source attributes with the tree of its own last tick, which may come a
        # moment after /metrics shows the job: a trace read before it counts for no job
        time.sleep(2.0)
        began = time.monotonic()
        staged = folder / f"profagent_x_{victim.pid}.json.tmp"  # as libkineto writes: a .tmp renamed
        staged.write_text(trace_of(victim.pid))
        staged.rename(folder / f"profagent_x_{victim.pid}.json")

        def ingested() -> float:
            rows = parse_metrics(http_get(url + "/metrics")).get("profagent_traces_total", [])
            return sum(v for lab, v in rows if lab.get("status") == "ingested")

        wait_for(lambda: ingested() >= 1, 30, interval=0.2, what="root's trace ingested")
        latency = time.monotonic() - began
        watches = _inotify_watches(agent.proc.pid)
        print(f"inotify watches {watches_before} -> {watches} with 6,000 folders; ingested after {latency:.1f} s")
        assert watches == watches_before, (watches_before, watches)
        assert json.loads((folder / f"profagent_x_{victim.pid}.json").read_text())  # left as it was
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_doctor_says_what_to_do_about_an_ondemand_folder_a_user_made_first(tmp_path: Path) -> None:
    """Issue 41 item 14: nobody pre-creates the on-demand folder (on-demand tracing is then
    off, as documented); `profagent doctor` names the folder, its owner and the fix."""
    import sys

    tok = token()
    folder = f"/tmp/paw-ondemand-{tok}"
    made = subprocess.run(as_nobody("/bin/mkdir", folder), capture_output=True, text=True, timeout=30)
    assert made.returncode == 0, made.stderr
    cfg = tmp_path / "doctor.toml"
    cfg.write_text(f'[ondemand]\ntrace_dir = "{folder}"\nsocket_dir = "{tmp_path}"\n'
                   f'control_socket = "{tmp_path / "control"}"\n')
    try:
        res = subprocess.run([sys.executable, "-m", "profagent", "doctor", "--config", str(cfg)],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "1000"})
    finally:
        os.rmdir(folder)
    line = next((ln for ln in res.stdout.splitlines() if "on-demand trace folder" in ln), "")
    assert f"{folder} is a folder of user nobody, made before the agent" in res.stdout, res.stdout
    assert line and f"rm -r {folder}" in res.stdout

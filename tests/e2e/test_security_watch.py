"""Watch mode beside an unprivileged user: `nobody` cannot fill max_jobs to hide root's job,
nor join root's job by setting its SLURM_JOB_ID. Real processes, really run as nobody."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.processes import kill_tree, wait_for
from helpers.watch import job_env, token
from profagent.config import load_config
from profagent.errors import UserError
from profagent.target.node import Limits, NodeTarget, Rules

NOBODY = 65534
SLEEPER = "import time\nwhile True:\n    time.sleep(0.05)\n"
SETPRIV = shutil.which("setpriv")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None, reason="needs root and setpriv to play nobody"),
]


@pytest.fixture
def as_nobody() -> Iterator:
    """Start SLEEPER as uid/gid 65534 with the given environment (script world-readable)."""
    folder = Path(tempfile.mkdtemp(prefix="paw-nobody-"))
    folder.chmod(0o755)
    script = folder / "job.py"
    script.write_text(SLEEPER)
    script.chmod(0o644)
    procs: list[subprocess.Popen] = []

    def start(env: dict[str, str]) -> subprocess.Popen:
        cmd = [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "/usr/bin/python3", str(script)]
        proc = subprocess.Popen(cmd, env={"PATH": "/usr/bin:/bin", **env}, start_new_session=True)
        procs.append(proc)
        wait_for(lambda: os.stat(f"/proc/{proc.pid}").st_uid == NOBODY, what="nobody's process")
        return proc

    yield start
    for proc in procs:
        kill_tree(proc)
    shutil.rmtree(folder, ignore_errors=True)


def _target(tok: str, **limits) -> NodeTarget:
    rules = Rules(None, (("PAW_TOKEN", tok),), False)
    return NodeTarget(rules, Limits(**{"scan_interval": 0.1, **limits}), settle_seconds=0.0, self_pid=-1)


def _pids_by_job(tree) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for p in tree.processes:
        out.setdefault(p.job_id, set()).add(p.pid)
    return out


def test_nobody_claiming_roots_job_id_gets_a_job_of_its_own(children, as_nobody) -> None:
    tok = token()
    env = job_env(tok, SLURM_JOB_ID="realjob42", SLURM_PROCID="0")
    mine = children.python(SLEEPER, env=env)
    target = _target(tok)
    wait_for(lambda: _pids_by_job(target.refresh()) == {"realjob42": {mine.pid}}, what="root's job")
    theirs = as_nobody(env)

    def both():
        tree = target.refresh()
        return tree if len(tree.processes) == 2 else None

    tree = wait_for(both, what="nobody's process seen")
    assert _pids_by_job(tree) == {"realjob42": {mine.pid}, "realjob42@nobody": {theirs.pid}}
    assert tree.job_status() == {"realjob42": True, "realjob42@nobody": True}
    for _ in range(3):  # stable: the labels do not swap on later ticks
        target._last_scan = None
        assert _pids_by_job(target.refresh()) == {"realjob42": {mine.pid}, "realjob42@nobody": {theirs.pid}}


def test_whoever_comes_first_processes_of_two_users_never_share_a_job(children, as_nobody) -> None:
    tok = token()
    env = job_env(tok, SLURM_JOB_ID="realjob42", SLURM_PROCID="0")
    theirs = as_nobody(env)  # planted before root's job starts
    target = _target(tok, grace_seconds=0.0)
    wait_for(lambda: _pids_by_job(target.refresh()) == {"realjob42": {theirs.pid}}, what="nobody's job")
    mine = children.python(SLEEPER, env=env)
    tree = wait_for(lambda: (t := target.refresh()) and len(t.processes) == 2 and t, what="root's process seen")
    assert _pids_by_job(tree) == {"realjob42": {theirs.pid}, "realjob42@root": {mine.pid}}
    # once nobody's job is gone and its grace is over, the id is free again
    kill_tree(theirs)
    wait_for(lambda: _pids_by_job(target.refresh()) == {"realjob42": {mine.pid}}, what="root's job alone")


@pytest.mark.parametrize("var", ["TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"])
def test_a_label_cannot_be_forged_by_choosing_an_id(children, as_nobody, var: str) -> None:
    """Issue 51 high 3: nobody claims ``victim-job`` first, so root's job is labelled
    ``victim-job@root``; then nobody starts processes whose id is that label (with RANK 0
    and 1 of root's job, and SLURM_JOB_USER=root for the Slurm variant). Bound: root's
    job holds root's processes only, on every tick; nobody's forged id is a label of its
    own, suffixed with its user. In the Slurm variant root's job, vouched for by its
    SLURM_JOB_USER, takes the plain id back and nobody's claim becomes ``victim-job@nobody``."""
    tok = token()
    extra = {"SLURM_JOB_USER": "root"} if var == "SLURM_JOB_ID" else {}
    claimer = as_nobody(job_env(tok, **{var: "victim-job"}, RANK="0", **extra))
    target = _target(tok, grace_seconds=0.0)
    wait_for(lambda: _pids_by_job(target.refresh()) == {"victim-job": {claimer.pid}}, what="nobody's claim")
    mine = [children.python(SLEEPER, env=job_env(tok, **{var: "victim-job"}, RANK=str(r), **extra)) for r in (0, 1)]
    forged = [as_nobody(job_env(tok, **{var: "victim-job@root"}, RANK=str(r), **extra)) for r in (0, 1)]

    def all_seen():
        tree = target.refresh()
        return tree if len(tree.processes) == 5 else None

    tree = wait_for(all_seen, what="every process watched")
    expected = {"victim-job": {claimer.pid}, "victim-job@root": {p.pid for p in mine},
                "victim-job@root@nobody": {p.pid for p in forged}}
    if extra:  # root's SLURM_JOB_USER is its own: vouched, its job takes the plain id back
        expected.update({"victim-job": {p.pid for p in mine}, "victim-job@nobody": {claimer.pid}})
        del expected["victim-job@root"]
    assert _pids_by_job(tree) == expected
    for _ in range(3):
        target._last_scan = None
        assert _pids_by_job(target.refresh()) == expected


def test_three_nobody_jobs_cannot_hide_roots_job(children, as_nobody, caplog) -> None:
    tok = token()
    target = _target(tok, max_jobs=3)  # per user: half of it, at least 1
    fillers = [as_nobody(job_env(tok, SLURM_JOB_ID=f"fill-{i}", SLURM_PROCID="0")) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="profagent.target.node"):
        def nobody_scanned():
            target._last_scan = None
            target.refresh()
            return len(target._ignored) == 2  # all three looked at: one admitted, two refused
        wait_for(nobody_scanned, what="nobody's three jobs examined")
        assert len(_pids_by_job(target.refresh())) == 1
        mine = children.python(SLEEPER, env=job_env(tok, SLURM_JOB_ID="realjob42", SLURM_PROCID="0"))
        tree = wait_for(lambda: (t := target.refresh()) and "realjob42" in t.job_status() and t, what="root's job admitted")
        for _ in range(5):
            target._last_scan = None
            target.refresh()
    assert _pids_by_job(tree)["realjob42"] == {mine.pid}
    assert len(tree.job_status()) == 2
    nobody_pids = {p.pid for p in fillers}
    watched_nobody = {pid for pids in _pids_by_job(tree).values() for pid in pids} & nobody_pids
    assert len(watched_nobody) == 1
    lines = [r.getMessage() for r in caplog.records if "max_jobs_per_user" in r.getMessage()]
    assert len(lines) == 2, lines  # one line per refused job, not per scan
    assert all("of user nobody" in line and "raise watch.max_jobs_per_user" in line for line in lines)


def test_max_jobs_per_user_is_validated_and_defaults_to_half() -> None:
    assert Limits(max_jobs=16).per_user == 8 and Limits(max_jobs=3).per_user == 1
    assert Limits(max_jobs=16, max_jobs_per_user=16).per_user == 16
    cfg = load_config(overrides={"watch.max_jobs_per_user": 4})
    assert Limits.from_config(cfg.watch).per_user == 4
    with pytest.raises(UserError, match="max_jobs_per_user"):
        load_config(overrides={"watch.max_jobs_per_user": -1})


# nobody's launcher starts a rank (sleep 0.4 with a RANK of its own) every 20 ms: 50 a second
CHURN = """
import itertools, subprocess, time
live = []
for i in itertools.count():
    live.append(subprocess.Popen(["/bin/sleep", "0.4"], env={"RANK": str(i), "WORLD_SIZE": "100000"}))
    live = [p for p in live if p.poll() is None]
    time.sleep(0.02)
"""
VICTIM_RANKS = """
import subprocess, time
ranks = [subprocess.Popen(["/bin/sleep", "3600"], env={"RANK": str(r), "WORLD_SIZE": "2"}) for r in (0, 1)]
time.sleep(3600)
"""


def test_a_user_churning_fifty_ranks_a_second_costs_discovery_a_bounded_amount(children) -> None:
    """Issue 51 low 6 (the attack: 50 short-lived ranks a second kept the agent at 32% of
    a core). nobody's job starts them for 10 s of 0.5 s ticks beside root's job of two
    ranks. Work counted: the /proc/PID/environ reads of nobody's processes (each new
    process of a job costs one, plus its stat, cmdline and placement: 14 a tick without a
    budget). Bound: at most watch.max_new_processes_per_user (4 here) new processes of one
    user a tick, so nobody's reads stay under twice that a tick (a process younger than 2 s
    has its environ read again at each tick it lives, as any job's); root's two
    ranks are in the tree at every tick; nobody's job is still seen, with ranks."""
    from collections import Counter

    from helpers.nobody import nobody_python
    from profagent.system.procfs import read_environ

    reads: Counter[int] = Counter()

    def counting(proc_root: Path, pid: int) -> dict[str, str]:
        try:
            reads[os.stat(f"/proc/{pid}").st_uid] += 1
        except OSError:
            pass
        return read_environ(proc_root, pid)

    tok = token()
    folder = Path(tempfile.mkdtemp(prefix="paw-churn-"))  # nobody reads its script there
    folder.chmod(0o755)
    limits = Limits(scan_interval=0.5, max_new_processes_per_user=4)  # under the flood's 25 a tick
    target = NodeTarget(Rules(None, (("PAW_TOKEN", tok),), False), limits, settle_seconds=0.0,
                        self_pid=-1, environ_reader=counting)
    victim = children.python(VICTIM_RANKS, env=job_env(tok, SLURM_JOB_ID="victim-51"))
    wait_for(lambda: len([p for p in target.refresh().processes if p.role == "main"]) == 2, what="root's two ranks")
    churn = nobody_python(CHURN, {"PAW_TOKEN": tok, "SLURM_JOB_ID": "churn"}, folder)
    try:
        wait_for(lambda: "churn" in target.refresh().job_status(), what="nobody's job")
        reads.clear()
        ticks, churn_ranks, cpu = 0, set(), 0.0
        began = time.monotonic()
        while time.monotonic() - began < 10:
            t0 = time.thread_time()
            tree = target.refresh()
            cpu += time.thread_time() - t0
            ticks += 1
            mains = {(p.job_id, p.rank) for p in tree.processes if p.role == "main"}
            assert {("victim-51", "0"), ("victim-51", "1")} <= mains, mains
            churn_ranks |= {r for j, r in mains if j == "churn"}
            time.sleep(0.5)
    finally:
        kill_tree(churn)
        kill_tree(victim)
        shutil.rmtree(folder, ignore_errors=True)
    per_tick = reads[NOBODY] / ticks
    print(f"{ticks} ticks: nobody's environ reads {per_tick:.1f} a tick, {len(churn_ranks)} of its ranks seen; "
          f"refresh CPU {cpu / ticks * 1000:.1f} ms a tick")
    assert len(churn_ranks) >= 10
    assert per_tick <= 2 * limits.max_new_processes_per_user, per_tick

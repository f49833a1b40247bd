"""NodeTarget: discovery rules, grouping into jobs, grace, limits (real processes, in-process)."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from helpers.agent import free_port
from helpers.processes import wait_for
from helpers.watch import FAKE_TORCHRUN, job_env, token, watch_config
from profagent.config import WatchConfig, load_config
from profagent.errors import UserError
from profagent.target.node import Limits, NodeTarget, Rules

SLEEPER = "import time\nwhile True:\n    time.sleep(0.05)\n"


def _target(tok: str, clock=None, settle: float = 0.0, **limits) -> NodeTarget:
    rules = Rules(None, (("PAW_TOKEN", tok),), False)
    kw = {"clock": clock} if clock else {}
    # self_pid=-1: the test's children are the pytest process' own (the agent's would be skipped)
    return NodeTarget(rules, Limits(**{"scan_interval": 0.1, **limits}), settle_seconds=settle, self_pid=-1, **kw)


def _jobs(tree) -> dict[str, bool]:
    return tree.job_status()


def _by_job(tree) -> dict[str, list]:
    out: dict[str, list] = {}
    for p in tree.processes:
        out.setdefault(p.job_id, []).append(p)
    return out


def test_fake_torchrun_is_one_job_with_launcher_and_ranks(children) -> None:
    tok = token()
    launcher = children.python(FAKE_TORCHRUN, env=job_env(tok, RANK_ENV="SLURM_JOB_ID=777"))
    target = _target(tok, settle=30)  # the launcher lacks SLURM_JOB_ID: wait for its ranks

    def found():
        tree = target.refresh()
        procs = _by_job(tree).get("777", [])
        return tree if len(procs) == 3 else None

    tree = wait_for(found, what="launcher and two ranks")
    procs = {p.pid: p for p in tree.processes}
    assert procs[launcher.pid].role == "launcher"
    ranks = sorted((p.rank, p.local_rank, p.world_size) for p in procs.values() if p.role == "main")
    assert ranks == [("0", "0", "2"), ("1", "1", "2")]
    assert _jobs(tree) == {"777": True}
    assert tree.alive and tree.job_id == ""


def test_ended_job_stays_for_grace_then_disappears(children) -> None:
    tok = token()
    now = [1000.0]
    target = _target(tok, clock=lambda: now[0], grace_seconds=10.0)
    assert _jobs(target.refresh()) == {}  # a first scan before the job exists, every time
    launcher = children.python(FAKE_TORCHRUN, env=job_env(tok, SLURM_JOB_ID="g-1"))

    def jobs_after_a_scan() -> dict[str, bool]:
        # The target rescans only once its (injected) clock has moved by scan_interval: the
        # job, started after the first scan, is found by a later one.
        now[0] += 0.2
        return _jobs(target.refresh())

    wait_for(lambda: jobs_after_a_scan() == {"g-1": True}, what="job found")
    os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and its ranks
    launcher.wait()
    wait_for(lambda: jobs_after_a_scan() == {"g-1": False}, what="job ended")
    tree = target.refresh()
    assert tree.processes == ()
    now[0] += 9.0
    assert _jobs(target.refresh()) == {"g-1": False}
    now[0] += 2.0
    assert _jobs(target.refresh()) == {}


def test_srun_tasks_with_one_slurm_job_id_form_one_job(children) -> None:
    tok = token()
    for rank in range(2):
        children.python(SLEEPER, env=job_env(tok, SLURM_JOB_ID="s-9", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS="2"))
    target = _target(tok)
    tree = wait_for(lambda: (t := target.refresh()) and len(t.processes) == 2 and t, what="two tasks")
    assert _jobs(tree) == {"s-9": True}
    assert sorted(p.rank for p in tree.processes) == ["0", "1"]
    assert {p.role for p in tree.processes} == {"main"}


def test_ranks_under_an_unmarked_parent_are_grouped_by_parent(children) -> None:
    tok = token()
    # The launcher itself carries no marker: only its rank children do.
    code = f"""
import os, subprocess, sys, time
for r in range(2):
    env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", PAW_TOKEN="{tok}")
    subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: time.sleep(0.05)"], env=env)
while True:
    time.sleep(0.05)
"""
    launcher = children.python(code)
    target = _target(tok)
    tree = wait_for(lambda: (t := target.refresh()) and len(t.processes) == 3 and t, what="launcher adopted")
    assert _jobs(tree) == {f"{socket.gethostname()}:{launcher.pid}": True}
    assert {p.pid: p.role for p in tree.processes}[launcher.pid] == "launcher"


def test_launcher_waits_for_its_ranks_run_id(children) -> None:
    """torchrun sets TORCHELASTIC_RUN_ID only in the ranks: the job id must be it, not the PID."""
    tok = token()
    code = FAKE_TORCHRUN.replace("kids = []", "kids = []\ntime.sleep(1.0)")
    children.python(code, env=job_env(tok, RANK_ENV="TORCHELASTIC_RUN_ID=elastic-5"))
    rules = Rules(None, (("PAW_TOKEN", tok),), False)
    target = NodeTarget(rules, Limits(scan_interval=0.1), settle_seconds=30, self_pid=-1)
    seen: set[str] = set()

    def three():
        tree = target.refresh()
        seen.update(_jobs(tree))
        return len(tree.processes) == 3

    wait_for(three, what="the job with its ranks")
    assert seen == {"elastic-5"}


def test_a_late_run_id_is_a_relabel_not_an_end(children, tmp_path, caplog) -> None:
    """A launcher nothing names is admitted as HOST:PID; when its ranks bring a run id the
    job goes on under that id at once: no grace for the old id, and the log says relabel."""
    tok = token()
    go = tmp_path / "go"
    code = FAKE_TORCHRUN.replace("kids = []", f"kids = []\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.02)")
    launcher = children.python(code, env=job_env(tok, RANK_ENV="TORCHELASTIC_RUN_ID=elastic-6"))
    target = _target(tok, settle=0.0, grace_seconds=60.0)
    fallback = f"{socket.gethostname()}:{launcher.pid}"
    wait_for(lambda: _jobs(target.refresh()) == {fallback: True}, what="the launcher admitted as HOST:PID")
    go.touch()
    with caplog.at_level(logging.INFO, logger="profagent.target.node"):
        tree = wait_for(lambda: (t := target.refresh()) and len(t.processes) == 3 and t, what="its ranks")
    assert _jobs(tree) == {"elastic-6": True}  # the old id is not kept as an ended job
    assert {p.job_id for p in tree.processes} == {"elastic-6"}
    messages = [r.getMessage() for r in caplog.records]
    assert f"job {fallback} is now job elastic-6 (its ranks name it): its series go on under the new id" in messages
    assert not [m for m in messages if "ended" in m]


@pytest.mark.slow
def test_real_torchrun_is_named_by_its_rdzv_id_before_its_ranks(children, tmp_path) -> None:
    """A real torchrun launcher (c10d rendezvous, as over several nodes) carries its job id
    on its command line only: the job is admitted under it before any rank exists, and
    keeps it when the ranks come (no HOST:PID id, no relabel)."""
    tok = token()
    script = tmp_path / "rank.py"
    script.write_text("import os, time\nprint(os.environ['TORCHELASTIC_RUN_ID'], flush=True)\ntime.sleep(60)\n")
    torchrun = Path(sys.executable).parent / "torchrun"
    port = free_port()
    cmd = [str(torchrun), "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv_id=job-rt", "--max-restarts", "0", str(script)]
    proc = subprocess.Popen(cmd, env={**os.environ, **job_env(tok)}, start_new_session=True,
                            stdout=subprocess.PIPE, text=True)
    children.procs.append(proc)
    target = _target(tok, settle=60.0)  # a HOST:PID id would wait a minute: this one must not
    sightings: list[tuple[dict[str, bool], list[str]]] = []

    def with_its_rank():
        tree = target.refresh()
        if tree.processes:
            sightings.append((_jobs(tree), [p.role for p in tree.processes]))
        return len(tree.processes) >= 2

    wait_for(with_its_rank, timeout=60, interval=0.05, what="torchrun and its rank")
    assert {job for jobs, _ in sightings for job in jobs} == {"job-rt"}
    # first seen alone: the id came from torchrun's command line; and it is the launcher, not
    # a rank 0 that would stand still (a stall, a hang) while a rendezvous waits for nodes
    assert sightings[0][1] == ["launcher"]
    assert proc.stdout is not None and proc.stdout.readline().strip() == "job-rt"  # the ranks' own word


def test_max_jobs_logs_once_and_admits_later(children, caplog) -> None:
    tok = token()
    first = children.python(SLEEPER, env=job_env(tok, SLURM_JOB_ID="m-1", RANK="0"))
    target = _target(tok, max_jobs=1)
    wait_for(lambda: _jobs(target.refresh()) == {"m-1": True}, what="first job")
    children.python(SLEEPER, env=job_env(tok, SLURM_JOB_ID="m-2", RANK="0"))
    with caplog.at_level(logging.WARNING, logger="profagent.target.node"):
        for _ in range(10):
            target.refresh()
            target._last_scan = None  # scan on every call
    lines = [r.getMessage() for r in caplog.records if "max_jobs" in r.getMessage()]
    assert len(lines) == 1 and "ignoring job m-2" in lines[0] and "raise watch.max_jobs" in lines[0]
    assert "m-2" not in _jobs(target.refresh())
    first.kill()
    first.wait()
    wait_for(lambda: _jobs(target.refresh()).get("m-2") is True, what="second job admitted once the first ended")


def test_max_processes_per_job_keeps_launcher_and_ranks(children, caplog) -> None:
    tok = token()
    children.python(FAKE_TORCHRUN, env=job_env(tok, SLURM_JOB_ID="p-1", NRANKS="4"))
    target = _target(tok, max_processes_per_job=3)
    with caplog.at_level(logging.WARNING, logger="profagent.target.node"):
        wait_for(lambda: target.refresh() and any("max_processes_per_job" in r.getMessage() for r in caplog.records), what="limit hit")
        tree = target.refresh()
    assert len(tree.processes) == 3
    assert [p.role for p in tree.processes].count("launcher") == 1
    assert sum("max_processes_per_job" in r.getMessage() for r in caplog.records) == 1


def test_the_agent_and_its_children_are_never_candidates(children) -> None:
    tok = token()
    child = children.python(SLEEPER, env=job_env(tok, SLURM_JOB_ID="self-1"))
    rules = Rules(None, (("PAW_TOKEN", tok),), False)
    target = NodeTarget(rules, Limits(scan_interval=0.1), settle_seconds=0, self_pid=os.getpid())
    for _ in range(3):
        tree = target.refresh()
        target._last_scan = None
    assert child.pid not in {p.pid for p in tree.processes}


def test_cmdline_and_env_rules() -> None:
    rules = Rules.from_config(WatchConfig())
    assert rules.match_cmdline("/usr/bin/python3 /usr/local/bin/torchrun --nproc-per-node 8 train.py")
    assert rules.match_cmdline("python -m torch.distributed.run x.py")
    assert rules.match_cmdline("python3.11 -u /work/pretrain_gpt.py --lr 1")
    assert not rules.match_cmdline("python -m pytest tests/test_watch_discovery.py")
    assert not rules.match_cmdline("bash train.sh")
    assert rules.match_env({"PROFAGENT": "1"}) and not rules.match_env({"PROFAGENT": "0"})
    assert rules.match_env({"KINETO_USE_DAEMON": "1"}) and not rules.match_env({"KINETO_USE_DAEMON": ""})
    off = Rules.from_config(WatchConfig(cmdline_regex="", env_markers=[]))
    assert not off.match_cmdline("python train.py") and not off.match_env({"PROFAGENT": "1"})


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("watch.cmdline_regex", "python(", "fix the regular expression"),
        ("watch.env_markers", ["=x"], "use NAME or NAME=VALUE"),
        ("watch.max_jobs", 0, "watch.max_jobs to 1 or more"),
        ("watch.scan_interval", 0.01, "at least"),
        ("watch.grace_seconds", -1.0, "0 or more"),
    ],
)
def test_bad_watch_settings_are_one_line_errors(key, value, fragment) -> None:
    with pytest.raises(UserError, match=re.escape(fragment)):
        load_config(overrides={key: value})


def test_unknown_watch_key_suggests(tmp_path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[watch]\nmax_job = 3\n")
    with pytest.raises(UserError, match="did you mean 'watch.max_jobs'"):
        load_config(cfg)


def test_helpers_watch_config_loads(tmp_path) -> None:
    cfg = load_config(watch_config(tmp_path, "abc", grace_seconds=1.5))
    assert cfg.watch.env_markers == ["PAW_TOKEN=abc"] and cfg.watch.grace_seconds == 1.5
    assert cfg.watch.cmdline_regex == "" and not cfg.stacks.enabled


def test_a_shell_with_the_marker_is_not_a_job_but_its_python_is() -> None:
    tok = token()
    # `sh -c "python ...; true"`: the shell stays as the python's parent, both carry the marker.
    shell = subprocess.Popen(
        ["/bin/sh", "-c", f"{sys.executable} -c 'import time; time.sleep(3600)'; true"],
        env={**os.environ, **job_env(tok, SLURM_JOB_ID="sh-1")}, start_new_session=True,
    )
    try:
        target = _target(tok)
        tree = wait_for(lambda: (t := target.refresh()) and t.processes and t, what="the python process")
        pids = {p.pid for p in tree.processes}
        assert shell.pid not in pids
        assert len(pids) == 1 and psutil.Process(next(iter(pids))).ppid() == shell.pid
        assert _jobs(tree) == {"sh-1": True}
    finally:
        os.killpg(shell.pid, signal.SIGKILL)
        shell.wait()


def test_is_python() -> None:
    from profagent.target.node import _is_python

    assert _is_python("/opt/conda/bin/python3.11 -u train.py")
    assert _is_python("python train.py")
    assert not _is_python("/bin/bash /var/spool/slurmd/job42/slurm_script")
    assert not _is_python("srun python train.py")


def test_reconfigure_applies_new_markers_on_the_next_refresh(children) -> None:
    tok_a, tok_b = token(), token()
    job = children.python(SLEEPER, env=job_env(tok_b, SLURM_JOB_ID="rc-b"))
    # Only one scan follows the reconfigure (below): the job must have exec'd by then, or that
    # scan reads the forked child's environment, which is pytest's (seen under load).
    wait_for(lambda: psutil.Process(job.pid).environ().get("PAW_TOKEN") == tok_b,
             what="the job running with its own environment")
    target = _target(tok_a, scan_interval=3600.0)  # only the first refresh scans on its own
    assert _jobs(target.refresh()) == {}
    target.reconfigure(Rules(None, (("PAW_TOKEN", tok_b),), False), Limits(scan_interval=3600.0))
    wait_for(lambda: _jobs(target.refresh()) == {"rc-b": True}, what="job found after reconfigure")

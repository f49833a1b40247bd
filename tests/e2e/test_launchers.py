"""Ranks from real launchers: PyTorch Lightning's own, torch.multiprocessing.spawn and
``accelerate launch``.

Each job (tests/workloads/launchers.py) writes every rank's own account: its rank and
world from the framework, its PID and its DataLoader workers' PIDs. The agent attached
to the job's top process must show the same: ranks 0 and 1 of a world of 2, each at the
framework's PID, the workers as ``dataloader`` of their rank (profagent_target_info and
/api/ranks); watch mode, which builds its trees apart, the same.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.agent import free_port, http_get, parse_metrics
from helpers.paths import WORKLOADS
from helpers.processes import wait_for
from profagent.target.node import Limits, NodeTarget, Rules

# three jobs of about a minute each on 2 shared cores (torch imported by every rank and spawned worker)
pytestmark = [pytest.mark.slow, pytest.mark.slow_first]

JOB = WORKLOADS / "launchers.py"
NEEDS = {"lightning": "pytorch_lightning", "accelerate": "accelerate"}  # from the `frameworks` extra


def start(children, mode: str, out: Path, *args: str, launcher: tuple[str, ...] = (sys.executable,),
          env: dict[str, str] | None = None) -> subprocess.Popen:
    module = NEEDS.get(mode)
    if module and importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed: pip install -e '.[frameworks]' (the pinned framework versions)")
    out.mkdir()
    proc = subprocess.Popen([*launcher, str(JOB), mode, str(out), *args], start_new_session=True,
                            env={**os.environ, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=(out.parent / f"{mode}.log").open("w"))
    children.procs.append(proc)  # killed with its tree after the test
    return proc


def accounts(proc: subprocess.Popen, out: Path) -> dict[int, dict]:
    """Each rank's own account, once both ranks have written it (their workers exist)."""
    def written() -> dict[int, dict] | None:
        assert proc.poll() is None, (out.parent / f"{out.name}.log").read_text()[-3000:]
        files = sorted(out.glob("rank*.json"))
        return {int(f.stem[4:]): json.loads(f.read_text()) for f in files} if len(files) == 2 else None

    return wait_for(written, timeout=240, interval=0.5, what="both ranks' accounts")


def expected(own: dict[int, dict]) -> dict[int, tuple[str, str, str]]:
    """pid -> (role, rank, world_size) as the framework tells it."""
    want: dict[int, tuple[str, str, str]] = {}
    for rank, account in own.items():
        assert account["world"] == 2
        want[account["pid"]] = ("main", str(rank), "2")
    for rank, account in own.items():
        for pid in account["workers"]:
            want.setdefault(pid, ("dataloader", str(rank), "2"))  # a rank's child that is a rank stays one
    return want


def finish(proc: subprocess.Popen, out: Path) -> None:
    (out / "stop").touch()
    assert proc.wait(timeout=120) == 0, (out.parent / f"{out.name}.log").read_text()[-3000:]


def agent_view(run_agent, pid: int, want: dict[int, tuple[str, str, str]]) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    agent = run_agent(["attach", "--pid", str(pid), "--listen", f"127.0.0.1:{port}", "--interval", "0.5",
                       "--no-stacks", "--no-timeline"])
    agent.wait_healthy(base, timeout=60)  # beside two ranks and their workers starting on 2 cores

    def as_wanted() -> dict | None:
        info = parse_metrics(http_get(base + "/metrics")).get("profagent_target_info", [])
        seen = {int(lab["pid"]): (lab["role"], lab["rank"], lab["world_size"]) for lab, _ in info}
        return seen if all(seen.get(p) == w for p, w in want.items()) else None

    seen = wait_for(as_wanted, timeout=60, interval=0.5, what=f"target_info to show {want}")
    [job] = json.loads(http_get(base + "/api/ranks"))["jobs"]
    assert job["world_size"] == 2
    assert {r["rank"]: r["pid"] for r in job["ranks"]} == {r: p for p, (role, r, _) in want.items() if role == "main"}
    return seen


def watch_view(out: Path, gpu_pids: list[int] | None = None) -> dict[int, tuple[str, str, str]]:
    """The job as watch mode finds it: a root discovered by its command line (the job's
    private folder), or by the GPU rule from ``gpu_pids`` (the processes NVML would list),
    its tree built by the node target."""
    if gpu_pids is None:
        rules = Rules(cmdline=re.compile(re.escape(str(out))), env_markers=(), gpu_processes=False)
    else:
        rules = Rules(cmdline=None, env_markers=(), gpu_processes=True)
    node = NodeTarget(rules, Limits(scan_interval=0.0), self_pid=-1, settle_seconds=0.0,  # the job is ours: not left out
                      gpu_pids=(lambda: gpu_pids) if gpu_pids else None)
    tree = node.refresh()
    assert len(tree.jobs) == 1, tree.jobs
    return {p.pid: (p.role, p.rank, p.world_size) for p in tree.processes}


@pytest.mark.timeout(420)
def test_lightning_own_launcher(children, run_agent, tmp_path: Path) -> None:
    """``python train.py`` with Trainer(accelerator="cpu", devices=2, strategy="ddp"):
    rank 0 starts rank 1 as its child; neither is the other's DataLoader worker. Rank 0's
    workers are spawned: they carry LOCAL_RANK=0 and WORLD_SIZE=2, which rank 0 set
    in-process, and are its workers still; rank 1's are forked (its environment verbatim)."""
    out = tmp_path / "lightning"
    proc = start(children, "lightning", out, env={"LAUNCHERS_RANK0_WORKERS": "spawn"})
    own = accounts(proc, out)
    assert own[0]["pid"] == proc.pid and own[1]["pid"] in own[0]["workers"]  # rank 1 is rank 0's child
    want = expected(own)
    spawned = [p for p in own[0]["workers"] if p != own[1]["pid"]]
    assert all("LOCAL_RANK=0" in Path(f"/proc/{p}/environ").read_text() for p in spawned)
    seen = agent_view(run_agent, proc.pid, want)
    assert {p for p, (role, _, _) in seen.items() if role == "main"} == {own[0]["pid"], own[1]["pid"]}
    watched = watch_view(out)
    assert all(watched.get(p) == w for p, w in want.items()), watched
    finish(proc, out)


@pytest.mark.timeout(420)
def test_mp_spawn_with_dataloader_workers(children, run_agent, tmp_path: Path) -> None:
    """torch.multiprocessing.spawn: the ranks carry no variable; their workers are spawned
    by multiprocessing too (the same command line): the launcher's structure tells."""
    out = tmp_path / "spawn"
    proc = start(children, "spawn", out, str(free_port()))
    own = accounts(proc, out)
    want = expected(own)
    want[proc.pid] = ("launcher", "", "")
    seen = agent_view(run_agent, proc.pid, want)
    assert sorted(r for role, r, _ in seen.values() if role == "main") == ["0", "1"]
    watched = watch_view(out)
    assert all(watched.get(p) == w for p, w in want.items()), watched
    # the GPU rule finds the ranks alone (their command lines name no training script):
    # siblings started by multiprocessing are one job, rooted at their launcher
    watched = watch_view(out, gpu_pids=[own[0]["pid"], own[1]["pid"]])
    assert all(watched.get(p) == w for p, w in want.items()), watched
    finish(proc, out)


@pytest.mark.timeout(420)
def test_accelerate_launch(children, run_agent, tmp_path: Path) -> None:
    """``accelerate launch --multi_gpu`` runs torch's elastic agent in its own process (on
    CPU, Accelerator(cpu=True) makes it gloo): the ranks carry RANK, their workers too."""
    out = tmp_path / "accelerate"
    launch = (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(free_port()))
    proc = start(children, "accelerate", out, launcher=launch)
    own = accounts(proc, out)
    want = expected(own)
    want[proc.pid] = ("launcher", "", "")
    agent_view(run_agent, proc.pid, want)
    watched = watch_view(out)
    assert all(watched.get(p) == w for p, w in want.items()), watched
    finish(proc, out)

"""Pod and Slurm identity on profagent_target_info, from fixture /proc trees.

The process tree is a real child process (psutil finds it); what the target reads from
/proc (cgroup, environ) comes from a fixture tree written for each container runtime's
cgroup format. Nothing inside the job's root is read (see test_security_placement.py).
"""

from __future__ import annotations

import pwd
import subprocess
import sys
from pathlib import Path

import pytest

from profagent.exporters.families import Families
from profagent.exporters.families.agent import render_target
from profagent.state import State
from profagent.target import PidTarget

SERVICE_ACCOUNT_NAMESPACE = "var/run/secrets/kubernetes.io/serviceaccount/namespace"

UID = "8f3c5f2a-1b2c-4d5e-9f60-718293a4b5c6"
SYSTEMD_UID = UID.replace("-", "_")
CID = "4b8e2f1c" * 8

RUNTIMES = {
    "containerd-systemd-v2": f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope\n",
    "containerd-cgroupfs-v2": f"0::/kubepods/besteffort/pod{UID}/{CID}\n",
    "cri-o-systemd-v2": f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/crio-{CID}.scope\n",
    "docker-systemd-v1": (
        f"12:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/docker-{CID}.scope\n"
        f"11:cpu,cpuacct:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/docker-{CID}.scope\n"
        "1:name=systemd:/system.slice/containerd.service\n"
    ),
    "containerd-cgroupfs-v1": f"4:pids:/kubepods/burstable/pod{UID}/{CID}\n3:cpuset:/kubepods/burstable/pod{UID}/{CID}\n",
}


@pytest.fixture
def child() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _fixture_proc(root: Path, pid: int, cgroup: str, environ: dict[str, str], namespace: str | None) -> None:
    """``namespace``: what the container's service-account file says (never read)."""
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(cgroup)
    (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in environ.items()) + b"\0")
    if namespace is not None:
        ns = d / "root" / SERVICE_ACCOUNT_NAMESPACE
        ns.parent.mkdir(parents=True)
        ns.write_text(namespace)


def _info(tree) -> list[dict[str, str]]:
    out = Families()
    state = State()
    state.set_tree(tree)
    render_target(state.view(), out)
    fam = next(f for f in out if f.name == "profagent_target_info")
    return [dict(s.labels) for s in fam.samples]


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
def test_target_info_carries_the_pod_of_each_runtime(tmp_path: Path, child: subprocess.Popen, runtime: str) -> None:
    env = {"HOSTNAME": "trainer-7f9c-0", "POD_NAMESPACE": "ml-team", "RANK": "0", "WORLD_SIZE": "1"}
    _fixture_proc(tmp_path, child.pid, RUNTIMES[runtime], env, "from-the-file\n")
    tree = PidTarget(child.pid, proc_root=tmp_path).refresh()
    [labels] = _info(tree)
    assert (labels["namespace"], labels["pod"], labels["container"]) == ("ml-team", "trainer-7f9c-0", "")
    assert labels["rank"] == "0"


def test_a_process_outside_any_pod_has_no_pod_labels(tmp_path: Path, child: subprocess.Popen) -> None:
    _fixture_proc(tmp_path, child.pid, "0::/user.slice/user-0.slice/session-1.scope\n", {"HOSTNAME": "node7"}, None)
    [labels] = _info(PidTarget(child.pid, proc_root=tmp_path).refresh())
    assert (labels["namespace"], labels["pod"], labels["container"]) == ("", "", "")
    assert labels["user"]  # the owner of /proc/PID in the fixture tree


def test_slurm_identity_and_user_on_target_info(tmp_path: Path, child: subprocess.Popen) -> None:
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURMD_NODENAME": "gpu-node-17",
           "SLURM_JOB_NAME": "llama-pretrain", "SLURM_JOB_USER": "alice", "SLURM_LOCALID": "3", "SLURM_NTASKS": "8"}
    _fixture_proc(tmp_path, child.pid, "0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_3\n", env, None)
    [labels] = _info(PidTarget(child.pid, proc_root=tmp_path).refresh())
    assert labels["job_id"] == "4242"
    # the user is the owner of /proc/PID (the test's user), never SLURM_JOB_USER: the job's
    # word, which may name another user (issue 41 item 8)
    owner = pwd.getpwuid((tmp_path / str(child.pid)).stat().st_uid).pw_name
    assert owner != "alice"
    assert (labels["slurm_job_name"], labels["slurm_step"], labels["slurm_task"], labels["slurm_node"], labels["user"]) == (
        "llama-pretrain", "0", "3", "gpu-node-17", owner)


@pytest.mark.parametrize(("hostname", "namespace", "want"), [
    ("trainer-0", "ml-team", ("trainer-0", "ml-team")),
    ("trainer-0", "", ("trainer-0", "")),  # no POD_NAMESPACE: no namespace, the file is not read
    ("Trainer\x1b[2J", "ml\nteam", ("", "")),  # not Kubernetes names: omitted, never cleaned up
    ("a" * 254, "b" * 64, ("", "")),  # over the DNS subdomain and label lengths
    ("pod.sub.example", "a" * 63, ("pod.sub.example", "a" * 63)),
])
def test_pod_and_namespace_come_from_the_environment_only_when_valid(
        tmp_path: Path, child: subprocess.Popen, hostname: str, namespace: str, want: tuple[str, str]) -> None:
    env = {"HOSTNAME": hostname, "RANK": "0"}
    if namespace:
        env["POD_NAMESPACE"] = namespace
    _fixture_proc(tmp_path, child.pid, RUNTIMES["containerd-cgroupfs-v2"], env, "from-the-file\n")
    [labels] = _info(PidTarget(child.pid, proc_root=tmp_path).refresh())
    assert (labels["pod"], labels["namespace"]) == want


@pytest.mark.parametrize(("cgroup", "want"), [
    ("0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_3\n", "4242"),  # cgroup v2
    ("12:memory:/slurm/uid_1001/job_4242/step_0\n4:cpuset:/slurm/uid_1001/job_4242/step_0/task_1\n", "4242"),  # v1
    # a folder a user made in a subtree delegated to it: not slurmd's, not believed
    ("0::/user.slice/user-65534.slice/user@65534.service/slurm/uid_1001/job_4242\n", None),
    ("0::/user.slice/user-0.slice/session-1.scope\n", None),
])
def test_the_slurm_job_of_a_process_comes_from_slurmds_cgroup_only(tmp_path: Path, cgroup: str, want: str | None) -> None:
    """Issue 41 item 8: a job id a user cannot forge for another user's job."""
    from profagent.system.cgroup import slurm_job_of_cgroup

    _fixture_proc(tmp_path, 77, cgroup, {"SLURM_JOB_ID": "4242"}, None)
    assert slurm_job_of_cgroup(tmp_path, 77) == want
    assert slurm_job_of_cgroup(tmp_path, 78) is None  # gone

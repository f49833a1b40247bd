"""Pod and Slurm attribution from /proc/PID/cgroup and the environment (system/cgroup.py).

Each /proc tree below is written in the exact form that a real node shows, as reported
publicly for that runtime and driver (the reference is given with each case); IDs and
UIDs are our own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from profagent.system.cgroup import (
    PodIdentity,
    PodNames,
    SlurmIdentity,
    parse_pod_identity,
    pod_names,
    read_pod_identity,
    slurm_identity,
)

CID = "3f4c1d2e5a6b7c8d9e0f1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f"
UID = "5d1e7a2c-93b4-4f0e-8c6a-2b7d9e4f1a30"
SYSTEMD_UID = UID.replace("-", "_")


def v1(path: str, root_controllers: tuple[str, ...] = ("rdma", "misc")) -> str:
    """A cgroup v1 file: one line per hierarchy, like `cat /proc/PID/cgroup` on v1.

    Controllers the kubelet does not manage (rdma, misc) stay at "/" for every process.
    """
    controllers = [
        "freezer", "pids", "blkio", "cpuset", "perf_event", "hugetlb", "devices",
        "memory", "cpu,cpuacct", "net_cls,net_prio", "name=systemd",
    ]
    lines = [f"{13 - i}:{c}:/" for i, c in enumerate(root_controllers)]
    n = 13 - len(root_controllers)
    for c in controllers:
        lines.append(f"{n}:{c}:{path}")
        n -= 1
    lines.append("0::/")  # hybrid hierarchy: the unified line sits at / (or a systemd path)
    return "\n".join(lines) + "\n"


def write_proc(root: Path, pid: int, text: str) -> Path:
    (root / str(pid)).mkdir(parents=True)
    (root / str(pid) / "cgroup").write_text(text)
    return root


CASES = {
    # containerd, kubelet systemd driver, cgroup v2: one line. The slice/scope layout
    # is what `systemd-cgls` shows on such nodes (netdata/netdata#4868).
    "containerd-systemd-v2": (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/"
        f"cri-containerd-{CID}.scope\n",
        PodIdentity(UID, CID, "containerd", "Burstable"),
    ),
    # Guaranteed pods have no QoS level slice: kubepods-pod<uid>.slice under kubepods.slice.
    "containerd-systemd-v2-guaranteed": (
        f"0::/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope\n",
        PodIdentity(UID, CID, "containerd", "Guaranteed"),
    ),
    # containerd, kubelet cgroupfs driver, cgroup v2: /kubepods/<qos>/pod<uid>/<id>, the
    # container named by its bare ID (the cgroupsPath of containerd/containerd#4857).
    "containerd-cgroupfs-v2": (
        f"0::/kubepods/besteffort/pod{UID}/{CID}\n",
        PodIdentity(UID, CID, "", "BestEffort"),
    ),
    # Docker (or cri-dockerd), cgroupfs driver, cgroup v1: every hierarchy under
    # /kubepods/burstable/pod<uid>/<id> (cadvisor's listing in google/cadvisor#2540,
    # the mount in containers/crun#729).
    "docker-cgroupfs-v1": (
        v1(f"/kubepods/burstable/pod{UID}/{CID}"),
        PodIdentity(UID, CID, "", "Burstable"),
    ),
    # Docker (or cri-dockerd), systemd driver, cgroup v1: docker-<id>.scope, rdma at /
    # (lxc/lxc#3890, kontena/pharos-cluster#440).
    "docker-systemd-v1": (
        v1(f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/docker-{CID}.scope"),
        PodIdentity(UID, CID, "docker", "Burstable"),
    ),
    # CRI-O, systemd driver, cgroup v1: crio-<id>.scope, "files" hierarchy at /
    # (opencontainers/runc#4620, tkestack/gpu-manager#158).
    "crio-systemd-v1": (
        v1(
            f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{SYSTEMD_UID}.slice/crio-{CID}.scope",
            root_controllers=("files",),
        ),
        PodIdentity(UID, CID, "cri-o", "BestEffort"),
    ),
    # CRI-O, systemd driver, cgroup v2.
    "crio-systemd-v2": (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/crio-{CID}.scope\n",
        PodIdentity(UID, CID, "cri-o", "Burstable"),
    ),
    # CRI-O, cgroupfs driver: crio-<id> without .scope (cri-o/cri-o#812).
    "crio-cgroupfs-v2": (
        f"0::/kubepods/burstable/pod{UID}/crio-{CID}\n",
        PodIdentity(UID, CID, "cri-o", "Burstable"),
    ),
    # containerd, systemd driver, cgroup v1, where some hierarchies carry runc's
    # "slice:prefix:id" form and others sit under containerd.service
    # (open-telemetry/opentelemetry-java#4507).
    "containerd-systemd-v1-colon-form": (
        "\n".join([
            f"11:perf_event:/kubepods-besteffort-pod{SYSTEMD_UID}.slice:cri-containerd:{CID}",
            f"10:blkio:/system.slice/containerd.service/kubepods-besteffort-pod{SYSTEMD_UID}.slice:cri-containerd:{CID}",
            f"9:cpuacct,cpu:/system.slice/containerd.service/kubepods-besteffort-pod{SYSTEMD_UID}.slice:cri-containerd:{CID}",
            f"1:name=systemd:/system.slice/containerd.service/kubepods-besteffort-pod{SYSTEMD_UID}.slice:cri-containerd:{CID}",
        ]) + "\n",
        PodIdentity(UID, CID, "containerd", "BestEffort"),
    ),
    # A static pod (its UID is the manifest's hash, no dashes), containerd systemd v2
    # (netdata/netdata#4868 lists such slices next to the API pods).
    "static-pod": (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod8daa50c3a64c9ff60bb9eab7b44b56fd.slice/cri-containerd-{CID}.scope\n",
        PodIdentity("8daa50c3a64c9ff60bb9eab7b44b56fd", CID, "containerd", "Burstable"),
    ),
    # kind/minikube: the node is itself a container, and the kubelet nests its slices
    # under kubelet.slice with a "kubelet-" prefix (kubernetes/minikube#11280 shows a
    # kubepods.slice under /docker/<id>).
    "nested-kind-node": (
        f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
        f"kubelet-kubepods-besteffort-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope\n",
        PodIdentity(UID, CID, "containerd", "BestEffort"),
    ),
    # CRI-O's conmon lives in the pod slice but is not the container.
    "crio-conmon": (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/crio-conmon-{CID}.scope\n",
        PodIdentity(UID, "", "", "Burstable"),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pod_identity_from_proc(tmp_path: Path, name: str) -> None:
    text, expected = CASES[name]
    proc = write_proc(tmp_path / "proc", 4242, text)
    assert read_pod_identity(proc, 4242) == expected


@pytest.mark.parametrize("text", [
    # a systemd service on the host, cgroup v2 and v1
    "0::/system.slice/sshd.service\n",
    "12:memory:/user.slice/user-1000.slice/session-3.scope\n1:name=systemd:/user.slice\n0::/\n",
    # a Slurm task: slurmstepd's cgroup v2 layout, no pod
    "0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n",
    # a plain Docker container outside Kubernetes
    f"0::/system.slice/docker-{CID}.scope\n",
    # inside a container with a private cgroup namespace: nothing to see
    "0::/\n",
    # a directory named like a pod, but not under kubepods
    f"0::/srv/pod{UID}/{CID}\n",
    "",
    "garbage without colons\n",
])
def test_no_pod(tmp_path: Path, text: str) -> None:
    assert parse_pod_identity(text) is None
    proc = write_proc(tmp_path / "proc", 7, text)
    assert read_pod_identity(proc, 7) is None


def test_unreadable_or_gone_process(tmp_path: Path) -> None:
    assert read_pod_identity(tmp_path, 99999) is None


def test_pod_without_container_cgroup() -> None:
    # A process of the pod cgroup itself (e.g. the kubelet's own probe helpers)
    assert parse_pod_identity(f"0::/kubepods/pod{UID}\n") == PodIdentity(UID, "", "", "Guaranteed")


def test_unified_line_wins_over_v1_root_lines() -> None:
    text = f"2:rdma:/\n0::/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/cri-containerd-{CID}.scope\n"
    assert parse_pod_identity(text) == PodIdentity(UID, CID, "containerd", "Guaranteed")


def test_this_process_is_parsed_without_error() -> None:
    # Real /proc of the test machine: whatever it is, parsing must not raise.
    import os

    read_pod_identity(Path("/proc"), os.getpid())


# Environment of a task started by `srun` inside `sbatch` (variable names from Slurm's
# srun/sbatch manual pages, "OUTPUT ENVIRONMENT VARIABLES").
SRUN_ENV = {
    "SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEPID": "0",
    "SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURMD_NODENAME": "gpu-n017", "SLURM_NODEID": "1",
    "SLURM_JOB_NAME": "llama-pretrain", "SLURM_JOB_USER": "alice", "SLURM_NTASKS": "16",
    "PATH": "/usr/bin",
}


def test_slurm_identity_of_an_srun_task() -> None:
    assert slurm_identity(SRUN_ENV) == SlurmIdentity("4242", "0", "9", "gpu-n017", "llama-pretrain", "alice")


def test_slurm_identity_fallbacks_and_arrays() -> None:
    env = {"SLURM_JOBID": "77", "SLURM_STEPID": "3", "SLURM_NODEID": "0",
           "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "7"}
    ident = slurm_identity(env)
    assert ident == SlurmIdentity("77", "3", "", "0", "", "", array_job_id="70", array_task_id="7")


def test_batch_script_has_no_step() -> None:
    # The batch script itself: SLURM_JOB_ID but no step or task variables.
    assert slurm_identity({"SLURM_JOB_ID": "5", "SLURM_JOB_USER": "bob"}) == SlurmIdentity("5", "", "", "", "", "bob")


@pytest.mark.parametrize("env", [{}, {"SLURM_JOB_ID": ""}, {"RANK": "0", "TORCHELASTIC_RUN_ID": "x"}])
def test_not_slurm(env: dict[str, str]) -> None:
    assert slurm_identity(env) is None


def _kubelet_pods() -> dict:
    """A trimmed kubelet `GET /pods` answer (a v1 PodList) with the fields we read."""
    return {
        "kind": "PodList", "apiVersion": "v1",
        "items": [
            {
                "metadata": {"name": "other", "namespace": "default", "uid": "00000000-0000-0000-0000-000000000000"},
                "status": {"containerStatuses": []},
            },
            {
                "metadata": {"name": "trainer-0", "namespace": "ml", "uid": UID},
                "status": {
                    "qosClass": "Burstable",
                    "initContainerStatuses": [{"name": "fetch-data", "containerID": "containerd://" + "a" * 64}],
                    "containerStatuses": [
                        {"name": "sidecar", "containerID": "containerd://" + "b" * 64},
                        {"name": "trainer", "containerID": f"containerd://{CID}"},
                    ],
                },
            },
        ],
    }


def test_pod_names_from_kubelet_pod_list() -> None:
    pods = _kubelet_pods()
    assert pod_names(pods, UID, CID) == PodNames("ml", "trainer-0", "trainer")
    assert pod_names(pods, UID, "a" * 64) == PodNames("ml", "trainer-0", "fetch-data")
    assert pod_names(pods, UID) == PodNames("ml", "trainer-0", "")
    assert pod_names(pods, UID, "c" * 64) == PodNames("ml", "trainer-0", "")
    assert pod_names(pods, "no-such-uid", CID) is None
    assert pod_names({}, UID) is None
    assert pod_names({"items": None}, UID) is None


def test_cgroup_to_names_end_to_end(tmp_path: Path) -> None:
    proc = write_proc(tmp_path / "proc", 31337, CASES["containerd-systemd-v2"][0])
    ident = read_pod_identity(proc, 31337)
    assert ident is not None
    assert pod_names(_kubelet_pods(), ident.pod_uid, ident.container_id) == PodNames("ml", "trainer-0", "trainer")

"""Who a process belongs to, beyond the job: its Kubernetes pod or its Slurm job step.

Pure helpers, no state, no logging, nothing done at import time (each described above
``read_pod_identity``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

QOS_GUARANTEED = "Guaranteed"
QOS_BURSTABLE = "Burstable"
QOS_BESTEFFORT = "BestEffort"
_QOS = {"": QOS_GUARANTEED, "burstable": QOS_BURSTABLE, "besteffort": QOS_BESTEFFORT}

RUNTIME_CONTAINERD = "containerd"
RUNTIME_CRIO = "cri-o"
RUNTIME_DOCKER = "docker"
RUNTIME_UNKNOWN = ""  # cgroupfs driver: containerd and Docker both name the cgroup by the bare ID

# systemd driver: kubepods[-burstable|-besteffort]-pod<uid with _ for ->.slice (kind and
# some distributions nest it under kubelet.slice, prefixing every name with "kubelet-").
_SYSTEMD_POD = re.compile(r"^(?:kubelet-)?kubepods(?:-(burstable|besteffort))?-pod([0-9a-fA-F_]+)\.slice$")
# cgroupfs driver: /kubepods[/burstable|/besteffort]/pod<uid>
_CGROUPFS_POD = re.compile(r"^pod([0-9a-fA-F-]+)$")
_ID = r"([0-9a-f]{64})"
_CONTAINERS = (
    (re.compile(rf"^cri-containerd-{_ID}\.scope$"), RUNTIME_CONTAINERD),
    (re.compile(rf"^crio-{_ID}(?:\.scope)?$"), RUNTIME_CRIO),
    (re.compile(rf"^docker-{_ID}\.scope$"), RUNTIME_DOCKER),
    (re.compile(rf"^{_ID}$"), RUNTIME_UNKNOWN),
)
# cgroup v1 with the systemd driver, as containerd writes it in some set-ups: the last
# path element is runc's "slice:prefix:id" form rather than a .scope.
_SLICE_PREFIX_ID = re.compile(rf"^(.+\.slice):(cri-containerd|crio|docker):{_ID}$")
_PREFIX_RUNTIME = {"cri-containerd": RUNTIME_CONTAINERD, "crio": RUNTIME_CRIO, "docker": RUNTIME_DOCKER}


@dataclass(frozen=True)
class PodIdentity:
    """What a cgroup path says about a process in a Kubernetes pod."""

    pod_uid: str  # with dashes, as in the API (metadata.uid); static pods have a hash without dashes
    container_id: str  # 64 hex digits; "" for a process in the pod but outside a container
    runtime: str  # containerd, cri-o, docker, or "" when the path does not tell (cgroupfs driver)
    qos_class: str  # Guaranteed, Burstable or BestEffort (as in the pod's status.qosClass)


def _uid_from_systemd(raw: str) -> str:
    return raw.replace("_", "-")


def _pod_in_path(path: str) -> PodIdentity | None:
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        uid = qos = None
        rest = parts[i + 1:]
        combined = _SLICE_PREFIX_ID.match(part)
        if combined:  # "kubepods-...-pod<uid>.slice:cri-containerd:<id>" in one element
            part, prefix, cid = combined.groups()
            rest = [f"{prefix}:{cid}"]
        m = _SYSTEMD_POD.match(part)
        if m:
            qos = _QOS[(m.group(1) or "").lower()]
            uid = _uid_from_systemd(m.group(2))
        else:
            m = _CGROUPFS_POD.match(part)
            parents = [p.lower() for p in parts[max(0, i - 2):i]]
            if m and "kubepods" in parents:
                level = parents[-1] if parents[-1] in ("burstable", "besteffort") else ""
                qos, uid = _QOS[level], m.group(1)
        if uid is None:
            continue
        container_id, runtime = "", RUNTIME_UNKNOWN
        if rest:
            container_id, runtime = _container(rest[0])
        return PodIdentity(uid, container_id, runtime, qos)
    return None


def _container(name: str) -> tuple[str, str]:
    if ":" in name:
        prefix, _, cid = name.partition(":")
        if prefix in _PREFIX_RUNTIME and re.fullmatch(_ID, cid):
            return cid, _PREFIX_RUNTIME[prefix]
        return "", RUNTIME_UNKNOWN
    for pattern, runtime in _CONTAINERS:
        m = pattern.match(name)
        if m:
            return m.group(1), runtime
    # e.g. crio-conmon-<id>.scope (CRI-O's monitor, not the container) or a sub-cgroup
    # that the container made itself: the pod is known, the container is not.
    return "", RUNTIME_UNKNOWN


def parse_pod_identity(text: str) -> PodIdentity | None:
    """The pod of a process from the text of its ``/proc/PID/cgroup``, else None.

    Lines are ``hierarchy-ID:controllers:path``. The unified (v2) line ``0::path`` is
    looked at first; on cgroup v1 the first hierarchy whose path shows a pod wins (some
    controllers, e.g. ``rdma`` or ``misc``, sit at ``/`` for every process).
    """
    lines = []
    for line in text.splitlines():
        hid, sep, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not (sep and sep2):
            continue
        lines.append((hid != "0" or controllers != "", path))
    for _, path in sorted(lines, key=lambda item: item[0]):
        found = _pod_in_path(path)
        if found is not None:
            return found
    return None


# - ``read_pod_identity(proc_root, pid)`` reads ``/proc/PID/cgroup`` and returns the pod
#   UID, container ID, container runtime and QoS class encoded in the cgroup path, or
#   ``None`` for a process outside any pod. It knows cgroup v1 (one line per hierarchy)
#   and v2 (``0::PATH``), the kubelet's ``systemd`` driver
#   (``kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope``) and ``cgroupfs``
#   driver (``/kubepods/burstable/pod<uid>/<id>``), and containerd, CRI-O and
#   Docker/cri-dockerd container names.
# - ``parse_pod_identity(text)`` does the same on the file's text.
# - ``slurm_identity(environ)`` reads the Slurm variables of a process environment.
# - ``pod_names(pod_list, pod_uid, container_id)`` maps a pod UID (and container ID) to the
#   namespace, pod name and container name, given the kubelet's parsed ``/pods`` answer.
#   The cgroup path carries no names: they come only from the kubelet (or the API server),
#   so the caller does that I/O and passes the parsed JSON in.
#
# The cgroup path is the host's view: the agent must run in the host PID namespace (and
# read the host's ``/proc``) for it to show the kubepods hierarchy. Inside a container with
# a private cgroup namespace a process sees ``0::/`` and no pod can be found.
def read_pod_identity(proc_root: Path, pid: int) -> PodIdentity | None:
    """``parse_pod_identity`` of ``proc_root/PID/cgroup``; None if it cannot be read."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:  # gone, or not ours to read
        return None
    return parse_pod_identity(text)


# slurmd's cgroup of a job's processes: /slurm/uid_1001/job_12345/step_0 (cgroup v1),
# /system.slice/slurmstepd.scope/job_12345/step_0/user/task_0 (v2). Only root (slurmd)
# makes these folders, at the top of the hierarchy where no user is delegated a subtree
# (hence anchored: /user.slice/.../slurm/job_1 is a folder a user made), so a user cannot
# put a process into another user's job this way.
_SLURM_JOB_CGROUP = re.compile(r"^/(?:slurm/uid_\d+|system\.slice/slurmstepd\.scope)/job_(\d+)(?:/|$)")


def slurm_job_of_cgroup(proc_root: Path, pid: int) -> str | None:
    """The Slurm job id in the process' cgroup path, None when it is in no Slurm job's
    cgroup (or is gone)."""
    try:
        text = (proc_root / str(pid) / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        m = _SLURM_JOB_CGROUP.search(line.rsplit(":", 1)[-1])
        if m:
            return m.group(1)
    return None


@dataclass(frozen=True)
class SlurmIdentity:
    """A process' place in a Slurm allocation, from its environment ("" = not set)."""

    job_id: str  # SLURM_JOB_ID (unique per array task too)
    step_id: str  # SLURM_STEP_ID: "0", "1"... for srun steps; "batch"/"extern" are not exported
    task: str  # SLURM_PROCID: the task's global rank in the step
    node: str  # SLURMD_NODENAME, else SLURM_NODEID (the node's index in the allocation)
    job_name: str  # SLURM_JOB_NAME
    user: str  # SLURM_JOB_USER
    array_job_id: str = ""  # SLURM_ARRAY_JOB_ID, for job arrays
    array_task_id: str = ""  # SLURM_ARRAY_TASK_ID


def _first(environ: Mapping[str, str], *names: str) -> str:
    for name in names:
        value = environ.get(name, "")
        if value:
            return value
    return ""


def slurm_identity(environ: Mapping[str, str]) -> SlurmIdentity | None:
    """Slurm identity from an environment (e.g. a parsed /proc/PID/environ); None outside Slurm.

    The pre-17.11 spellings (SLURM_JOBID, SLURM_STEPID, SLURM_NODENAME) are accepted as
    fallbacks.
    """
    job_id = _first(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    if not job_id:
        return None
    return SlurmIdentity(
        job_id=job_id,
        step_id=_first(environ, "SLURM_STEP_ID", "SLURM_STEPID"),
        task=_first(environ, "SLURM_PROCID"),
        node=_first(environ, "SLURMD_NODENAME", "SLURM_NODENAME", "SLURM_NODEID"),
        job_name=_first(environ, "SLURM_JOB_NAME"),
        user=_first(environ, "SLURM_JOB_USER"),
        array_job_id=_first(environ, "SLURM_ARRAY_JOB_ID"),
        array_task_id=_first(environ, "SLURM_ARRAY_TASK_ID"),
    )


@dataclass(frozen=True)
class PodNames:
    namespace: str
    pod: str
    container: str  # "" when the container ID is unknown or not (yet) in the pod's status


def pod_names(pod_list: Mapping, pod_uid: str, container_id: str = "") -> PodNames | None:
    """Namespace, pod and container names of a pod UID, from the kubelet's ``/pods`` JSON.

    ``pod_list`` is the parsed body of the kubelet's read-only ``GET /pods`` (a v1
    ``PodList``: ``items[].metadata.uid/name/namespace`` and
    ``items[].status.containerStatuses[].name/containerID``, with IDs written
    ``runtime://<id>``). The kubelet answers for its own node only, which is all an agent
    on that node needs. Init and ephemeral containers are matched too. Pure: no I/O.
    """
    for item in pod_list.get("items") or ():
        meta = item.get("metadata") or {}
        if meta.get("uid") != pod_uid:
            continue
        container = ""
        if container_id:
            status = item.get("status") or {}
            for key in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"):
                for cs in status.get(key) or ():
                    if (cs.get("containerID") or "").rpartition("://")[2] == container_id:
                        container = cs.get("name", "")
                        break
                if container:
                    break
        return PodNames(meta.get("namespace", ""), meta.get("name", ""), container)
    return None

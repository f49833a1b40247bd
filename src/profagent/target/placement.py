"""Where a process runs, beyond its job: its Kubernetes pod or its Slurm step, and its user.

Read once per process (PID and start time) by the target and exported only as labels of
``profagent_target_info``, so dashboards can join on them without spreading other series.

Names come from what the node itself shows, without any API call:

- the pod UID and container ID from ``/proc/PID/cgroup`` (``system/cgroup.py``);
- the pod name from the process' ``HOSTNAME`` (Kubernetes sets it to the pod name unless
  the pod sets ``hostname:``), and the namespace from the service-account file the
  kubelet mounts into the container (read through ``/proc/PID/root``, small and bounded);
- the container name only from a kubelet ``/pods`` answer, when one is given;
- Slurm's job name, step, task and node from the environment (``SLURM_*``).
"""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from profagent.system.cgroup import pod_names, read_pod_identity, slurm_identity

LABELS = ("namespace", "pod", "container", "slurm_job_name", "slurm_step", "slurm_task", "slurm_node", "user")
SERVICE_ACCOUNT_NAMESPACE = "var/run/secrets/kubernetes.io/serviceaccount/namespace"
_NAME_MAX = 253  # a Kubernetes namespace or pod name (DNS subdomain) is at most this long


@dataclass(frozen=True)
class Placement:
    namespace: str = ""
    pod: str = ""
    container: str = ""
    slurm_job_name: str = ""
    slurm_step: str = ""
    slurm_task: str = ""
    slurm_node: str = ""
    user: str = ""

    def labels(self) -> tuple[str, ...]:
        """Values in the order of ``LABELS``."""
        return tuple(getattr(self, name) for name in LABELS)


NOWHERE = Placement()


def read_small_text(path: Path, limit: int = _NAME_MAX) -> str:
    """A short regular file's first line; "" for anything else (FIFO, device, missing, too long)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        data = os.read(fd, limit + 1)
    except OSError:
        return ""
    finally:
        os.close(fd)
    if len(data) > limit:
        return ""
    return data.decode("utf-8", "replace").strip().splitlines()[0] if data.strip() else ""


def _owner(proc_root: Path, pid: int) -> str:
    try:
        uid = (proc_root / str(pid)).stat().st_uid
    except OSError:
        return ""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def placement_of(
    proc_root: Path, pid: int, environ: Mapping[str, str], pod_list: Mapping | None = None
) -> Placement:
    """The placement of one process. Never raises; unknown parts stay ""."""
    slurm = slurm_identity(environ)
    namespace = pod = container = ""
    identity = read_pod_identity(proc_root, pid)
    if identity is not None:
        names = pod_names(pod_list, identity.pod_uid, identity.container_id) if pod_list else None
        if names is not None:
            namespace, pod, container = names.namespace, names.pod, names.container
        else:
            pod = environ.get("HOSTNAME", "")[:_NAME_MAX]
            namespace = read_small_text(proc_root / str(pid) / "root" / SERVICE_ACCOUNT_NAMESPACE)
    return Placement(
        namespace=namespace,
        pod=pod,
        container=container,
        slurm_job_name=slurm.job_name if slurm else "",
        slurm_step=slurm.step_id if slurm else "",
        slurm_task=slurm.task if slurm else "",
        slurm_node=slurm.node if slurm else "",
        user=(slurm.user if slurm and slurm.user else _owner(proc_root, pid)),
    )

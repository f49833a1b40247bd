"""Where a process runs, beyond its job: its Kubernetes pod or its Slurm step, and its user.

Read once per process (PID and start time) by the target and exported only as labels of
``profagent_target_info``, so dashboards can join on them without spreading other series.
"""

from __future__ import annotations

import pwd
import re
from collections.abc import Mapping
from pathlib import Path

from profagent.contracts import Placement
from profagent.system.cgroup import pod_names, read_pod_identity, slurm_identity

# Kubernetes names: a namespace is a DNS label (63), a pod name a DNS subdomain (253).
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")



def _name_from_env(environ: Mapping[str, str], var: str, pattern: re.Pattern[str]) -> str:
    """``environ[var]`` if it is a valid Kubernetes name, else "" (when in doubt, no label)."""
    value = environ.get(var, "")
    return value if pattern.fullmatch(value) else ""


def _owner(proc_root: Path, pid: int) -> str:
    try:
        uid = (proc_root / str(pid)).stat().st_uid
    except OSError:
        return ""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


# Names come from what the node itself shows, without any API call:
#
# - the pod UID and container ID from ``/proc/PID/cgroup`` (``system/cgroup.py``);
# - namespace, pod and container names from a kubelet ``/pods`` answer, when one is given;
# - else the pod name from the process' ``HOSTNAME`` (Kubernetes sets it to the pod name
#   unless the pod sets ``hostname:``) and the namespace from ``POD_NAMESPACE`` (the usual
#   downward-API variable), each kept only if it is a valid Kubernetes name;
# - Slurm's job name, step, task and node from the environment (``SLURM_*``);
# - the user from the kernel: the process' owner. ``SLURM_JOB_USER`` is the job's word and
#   may name another user (``nobody`` claimed to be ``alice``), so it is not read here.
#
# Nothing is read inside the job's root (``/proc/PID/root``): the job controls its mount
# namespace (``unshare -Urm`` needs no privilege), so a path there, such as the
# service-account ``namespace`` file, may be a symlink that root would follow to a file of
# the host. Environment variables are the job's word too, but reading them opens no file.
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
            pod = _name_from_env(environ, "HOSTNAME", _DNS_SUBDOMAIN)
            namespace = _name_from_env(environ, "POD_NAMESPACE", _DNS_LABEL)
    return Placement(
        namespace=namespace,
        pod=pod,
        container=container,
        slurm_job_name=slurm.job_name if slurm else "",
        slurm_step=slurm.step_id if slurm else "",
        slurm_task=slurm.task if slurm else "",
        slurm_node=slurm.node if slurm else "",
        user=_owner(proc_root, pid),  # never SLURM_JOB_USER: the job's word, which names anyone
    )

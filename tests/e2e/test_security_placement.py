"""Item 1 of issue 25: reading a root-only file through the job's own root.

The attacker is a real process of ``nobody`` that makes itself a user and mount namespace
(``unshare -Urm``, no privilege needed), mounts a tmpfs on ``/var`` there and links the
pod's service-account ``namespace`` file to a file only root can read. A root agent
following that path through ``/proc/PID/root`` would publish the file's first line as
``namespace="…"``; the agent must not read inside the job's root at all.

Where unprivileged user namespaces are off, the link is planted in a stand-in root instead.
The kubepods cgroup of a pod cannot be given to a process here without touching the
node's cgroups, so the target reads a fixture ``/proc`` whose ``PID/cgroup`` is a pod's and
whose ``PID/root`` is the attacker's real ``/proc/PID/root``: everything the agent could
follow is the attacker's real namespace.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.nobody import as_nobody, nobody_python
from helpers.processes import kill_tree, wait_for
from profagent.exporters.exposition import Exposition
from profagent.state import State
from profagent.target import PidTarget

CID = "4b8e2f1c" * 8
POD_CGROUP = f"0::/kubepods/besteffort/pod8f3c5f2a-1b2c-4d5e-9f60-718293a4b5c6/{CID}\n"
SERVICE_ACCOUNT_NAMESPACE = "var/run/secrets/kubernetes.io/serviceaccount/namespace"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("unshare") is None,
    reason="plays a root agent against nobody's own mount namespace: needs root, setpriv and unshare")

ATTACK = """
    set -e
    mount -t tmpfs none /var
    mkdir -p /var/run/secrets/kubernetes.io/serviceaccount
    ln -s "$SECRET" /var/run/secrets/kubernetes.io/serviceaccount/namespace
    touch "$READY"
    exec /usr/bin/python3 -c 'import time; time.sleep(600)'
"""


@pytest.fixture
def secret() -> Iterator[tuple[Path, str]]:
    """A root-only file (0600 in a 0700 folder) and its first line."""
    folder = Path(tempfile.mkdtemp(prefix="paw-secret-"))
    path = folder / "shadow"
    words = f"TOPSECRET-{uuid.uuid4().hex}"
    path.write_text(words + "\nsecond line\n")
    path.chmod(0o600)
    yield path, words
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def attacker(secret: tuple[Path, str]) -> Iterator[tuple[int, Path]]:
    """nobody's job and its root as root sees it (``/proc/PID/root``), with the planted link.

    Where unprivileged user namespaces are off (a hardened kernel), the same link is
    planted in a folder standing for the job's root: the agent must not follow it either."""
    folder = Path(tempfile.mkdtemp(prefix="paw-unshare-"))
    folder.chmod(0o1777)
    ready = folder / "ready"
    env = {"PATH": "/usr/bin:/bin", "SECRET": str(secret[0]), "READY": str(ready),
           "HOSTNAME": "trainer-0", "RANK": "0", "WORLD_SIZE": "1"}
    proc = subprocess.Popen(as_nobody("unshare", "-Urm", "sh", "-c", textwrap.dedent(ATTACK)),
                            env=env, start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, 30, what="nobody's mount namespace")
        if proc.poll() is None:
            wait_for(lambda: "python3" in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace"),
                     30, what="the attacker's job running")
            yield proc.pid, Path(f"/proc/{proc.pid}/root")
        else:  # no user namespaces here: a planted symlink in a stand-in root
            proc = nobody_python("import time\ntime.sleep(600)\n",
                                 {k: v for k, v in env.items() if k != "PATH"}, folder)
            planted = folder / "root" / SERVICE_ACCOUNT_NAMESPACE
            planted.parent.mkdir(parents=True)
            planted.symlink_to(secret[0])
            yield proc.pid, folder / "root"
    finally:
        kill_tree(proc)
        shutil.rmtree(folder, ignore_errors=True)


def _fake_proc(proc_root: Path, pid: int, job_root: Path) -> None:
    d = proc_root / str(pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(POD_CGROUP)
    (d / "environ").write_bytes(Path(f"/proc/{pid}/environ").read_bytes())
    (d / "root").symlink_to(job_root)  # the attacker's real root, in its own mount namespace


def test_a_symlink_in_the_jobs_mount_namespace_never_reaches_metrics(
        tmp_path: Path, attacker: tuple[int, Path], secret: tuple[Path, str]) -> None:
    path, words = secret
    pid, job_root = attacker
    planted = job_root / SERVICE_ACCOUNT_NAMESPACE
    assert os.path.islink(planted)
    # the attack is live: following the path as root reads the root-only file
    assert planted.read_text().splitlines()[0] == words
    _fake_proc(tmp_path, pid, job_root)
    state = State()
    state.set_tree(PidTarget(pid, proc_root=tmp_path).refresh())
    body, _ = Exposition(state.view).render("text/plain")
    text = body.decode()
    assert words not in text
    info = [line for line in text.splitlines() if line.startswith("profagent_target_info{")]
    assert info and all('namespace=""' in line and 'pod="trainer-0"' in line for line in info), info
    assert path.stat().st_mode & 0o777 == 0o600  # untouched

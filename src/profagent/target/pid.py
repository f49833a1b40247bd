"""The target: a PID resolved, on every refresh, to the training job's process tree.

The tree is found again each time because torchrun restarts workers and DataLoader
workers come and go. Each process gets a role and a rank from its environment:

- ``main``: a process with its own rank (RANK, else SLURM_PROCID), or the root of a
  tree that has no rank anywhere (a single-process job: rank "0");
- ``dataloader``: any descendant of a main process, attributed to that rank (in a
  PyTorch job these are DataLoader workers; they inherit the rank's environment);
- ``launcher``: a process above the ranks (torchrun, srun's task launcher...), rank "".
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

from profagent.analysis.labels import shorten
from profagent.errors import UserError
from profagent.logs import LogOnce
from profagent.system.procfs import PROC, read_environ
from profagent.target.cmdline import label_cmdline
from profagent.target.placement import Placement, placement_of
from profagent.target.tree import (
    CMDLINE_MAX,
    JOB_VARS,
    ROLE_DATALOADER,
    ROLE_LAUNCHER,
    ROLE_MAIN,
    ProcessInfo,
    ProcessTree,
    rank_from_env,
)

log = logging.getLogger(__name__)


def not_a_training_job(proc: psutil.Process, proc_root: Path = PROC) -> str:
    """A one-line warning when neither ``proc`` nor any of its descendants is a Python
    process or carries a rank (RANK, SLURM_PROCID...), else "". Not a refusal: a launcher
    (a shell script, srun, a container's init) may start its Python ranks later."""
    try:
        procs = [proc, *proc.children(recursive=True)]
        name = proc.name()
    except psutil.Error:
        return ""  # gone or unreadable: check_attachable and the target say so
    for p in procs:
        try:
            argv = p.cmdline()
        except psutil.Error:
            continue
        if argv and "python" in argv[0].rsplit("/", 1)[-1]:
            return ""
        try:
            if rank_from_env(read_environ(proc_root, p.pid)) is not None:
                return ""
        except OSError:
            continue
    return (f"PID {proc.pid} ({name}) is not a Python process, nor is any process under it, and none has a rank "
            "(RANK, SLURM_PROCID): only its CPU and memory can be observed until one appears; "
            "did you mean the launcher (torchrun) or a rank? `pgrep -af train`")


def check_attachable(pid: int) -> psutil.Process:
    """Return the process, or raise UserError naming the problem and the fix."""
    if pid <= 1:
        raise UserError(f"PID {pid} is not a training job" + (" (PID 1 is the init system: it would watch the whole machine)" if pid == 1 else ""),
                        "pass the PID of the launcher (torchrun) or of a rank: `pgrep -f train`")
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            raise psutil.ZombieProcess(pid)
        proc.cpu_times()
        if not proc.cmdline() and (pid == 2 or proc.ppid() == 2):
            raise UserError(f"PID {pid} is a kernel thread, not a training job", "pass the PID of the launcher (torchrun) or of a rank")
        if os.geteuid() != 0:  # the ranks and job id come from its environment: without it, refuse
            (Path("/proc") / str(pid) / "environ").read_bytes()
        return proc
    except psutil.ZombieProcess:  # before NoSuchProcess: it is a subclass
        raise UserError(f"PID {pid} is a zombie (it has exited; its parent has not reaped it)", "attach to a running process") from None
    except psutil.NoSuchProcess:
        raise UserError(f"no process with PID {pid}", "check the PID with `ps -ef` or `pgrep -f train`") from None
    except (psutil.AccessDenied, PermissionError):
        try:
            owner = psutil.Process(pid).username()
        except psutil.Error:
            owner = "another user"
        raise UserError(
            f"not permitted to read PID {pid} (owned by {owner})",
            "run profagent as that user or as root (or with CAP_SYS_PTRACE)",
        ) from None
    except FileNotFoundError:
        raise UserError(f"no process with PID {pid}", "check the PID with `ps -ef` or `pgrep -f train`") from None


class PidTarget:
    """Resolves a PID to its process tree. ``refresh()`` is called once per tick."""

    def __init__(
        self,
        pid: int,
        proc_root: str | Path = PROC,
        environ_reader: Callable[[Path, int], dict[str, str]] = read_environ,
        cmdline_args: bool = False,
    ) -> None:
        self.pid = pid
        self.cmdline_args = cmdline_args  # agent.cmdline_args: arguments in the label (redacted)
        self.proc_root = Path(proc_root)
        self._read_environ = environ_reader
        self._env_cache: dict[tuple[int, float], dict[str, str] | None] = {}
        self._known: dict[int, float] = {}  # pid -> create_time seen in the last tree
        self._job_id: str | None = None
        self._log_once = LogOnce(log)
        self._placements: dict[tuple[int, float], Placement] = {}  # (pid, create_time) -> placement

    # -- discovery ---------------------------------------------------------------
    def _alive(self, pid: int, create_time: float | None) -> psutil.Process | None:
        try:
            proc = psutil.Process(pid)
            if create_time is not None and abs(proc.create_time() - create_time) > 0.01:
                return None  # PID reused by an unrelated process
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc
        except psutil.Error:
            return None

    def _collect(self) -> list[psutil.Process]:
        """The root and its descendants; if the root died, whatever we knew that lives on."""
        roots = []
        root = self._alive(self.pid, self._known.get(self.pid))
        if root is not None:
            roots.append(root)
        else:
            roots = [p for pid, ct in self._known.items() if (p := self._alive(pid, ct))]
        seen: dict[int, psutil.Process] = {}
        for proc in roots:
            seen[proc.pid] = proc
            try:
                for child in proc.children(recursive=True):
                    seen.setdefault(child.pid, child)
            except psutil.Error:
                continue
        return list(seen.values())

    def _environ(self, pid: int, create_time: float) -> dict[str, str] | None:
        key = (pid, create_time)
        if key not in self._env_cache:
            try:
                self._env_cache[key] = self._read_environ(self.proc_root, pid)
            except PermissionError:
                self._log_once(
                    logging.WARNING, "environ",
                    "cannot read /proc/%d/environ (permission denied): ranks and job id "
                    "fall back to rank 0 / the launcher PID; run as the job's user or root",
                    pid,
                )
                self._env_cache[key] = None
            except OSError:
                self._env_cache[key] = None
        return self._env_cache[key]

    # -- classification ------------------------------------------------------------
    def refresh(self) -> ProcessTree:
        procs = self._collect()
        info: dict[int, tuple[int, float, str]] = {}
        for proc in procs:
            try:
                with proc.oneshot():
                    if proc.status() == psutil.STATUS_ZOMBIE:
                        continue  # exited, not yet reaped by its parent
                    info[proc.pid] = (proc.ppid(), proc.create_time(), _short_cmdline(proc, self.cmdline_args))
            except psutil.Error:
                continue
        if not info:
            self._known = {}
            self._env_cache.clear()
            return ProcessTree(self._job_id or str(self.pid), self.pid, (), alive=False)

        envs = {pid: self._environ(pid, ct) or {} for pid, (_, ct, _) in info.items()}
        self._env_cache = {k: v for k, v in self._env_cache.items() if k[0] in info}
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in info.items():
            children.setdefault(ppid, []).append(pid)
        tops = sorted(pid for pid, (ppid, _, _) in info.items() if ppid not in info)
        ranked_below = _ranked_subtrees(tops, children, envs)
        any_rank = any(ranked_below.get(t, False) for t in tops)

        out: list[ProcessInfo] = []

        def visit(pid: int, main: ProcessInfo | None) -> None:
            ppid, ct, cmd = info[pid]
            own = rank_from_env(envs[pid])
            if main is not None:
                me = ProcessInfo(pid, ppid, ct, ROLE_DATALOADER, main.rank, main.local_rank, main.world_size, cmd)
            elif own is not None:
                me = ProcessInfo(pid, ppid, ct, ROLE_MAIN, own[0], own[1], own[2], cmd)
            elif not any_rank and pid in tops:
                me = ProcessInfo(pid, ppid, ct, ROLE_MAIN, "0", "0", "1", cmd)
            else:
                me = ProcessInfo(pid, ppid, ct, ROLE_LAUNCHER, "", "", "", cmd)
            out.append(me)
            next_main = me if me.role == ROLE_MAIN else main
            for child in sorted(children.get(pid, [])):
                visit(child, next_main)

        for top in tops:
            visit(top, None)
        self._known = {p.pid: p.create_time for p in out}
        self._placements = {k: v for k, v in self._placements.items() if k[0] in self._known}
        job_id = self._resolve_job_id(out, envs)
        processes = tuple(
            dataclasses.replace(p, job_id=job_id, placement=self._placement(p, envs.get(p.pid, {}))) for p in out
        )
        return ProcessTree(job_id, self.pid, processes, alive=True)

    def _placement(self, proc: ProcessInfo, environ: dict[str, str]) -> Placement:
        key = (proc.pid, proc.create_time)
        found = self._placements.get(key)
        if found is None:
            found = self._placements[key] = placement_of(self.proc_root, proc.pid, environ)
        return found

    def _resolve_job_id(self, procs: Iterable[ProcessInfo], envs: dict[int, dict[str, str]]) -> str:
        if self._job_id is not None:
            return self._job_id
        ordered = sorted(procs, key=lambda p: (p.role != ROLE_LAUNCHER, p.pid))
        for var in JOB_VARS:
            for proc in ordered:
                value = envs.get(proc.pid, {}).get(var)
                # torchrun's non-standalone default run id is "none": not an identity.
                if value and value != "none":
                    self._job_id = value  # stable from now on
                    return value
        return str(self.pid)


def _ranked_subtrees(
    tops: list[int], children: dict[int, list[int]], envs: dict[int, dict[str, str]]
) -> dict[int, bool]:
    """For each pid, whether it or a descendant carries a rank (iterative post-order)."""
    result: dict[int, bool] = {}
    stack: list[tuple[int, bool]] = [(t, False) for t in tops]
    while stack:
        pid, expanded = stack.pop()
        if expanded:
            result[pid] = rank_from_env(envs[pid]) is not None or any(
                result.get(c, False) for c in children.get(pid, [])
            )
        else:
            stack.append((pid, True))
            stack.extend((c, False) for c in children.get(pid, []))
    return result


def _short_cmdline(proc: psutil.Process, with_args: bool = False) -> str:
    try:
        parts = proc.cmdline()
    except psutil.Error:
        parts = []
    text = label_cmdline(parts, with_args) if parts else proc.name()
    return shorten(text, CMDLINE_MAX)

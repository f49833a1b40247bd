"""The target: a PID resolved, on every refresh, to the training job's process tree.

The tree is found again each time because torchrun restarts workers and DataLoader
workers come and go. Each process gets a role and a rank (target/ranks.py):

- ``main``: a rank: its own identity (RANK, OMPI_COMM_WORLD_RANK, PMI_RANK,
  SLURM_PROCID, LOCAL_RANK with WORLD_SIZE), or one its launcher's structure gives
  (Lightning's rank 0, mp.spawn's children); or the root of a tree that has no rank
  anywhere (a single-process job: rank "0");
- ``dataloader``: a descendant of a rank without an identity of its own, attributed to
  that rank (DataLoader workers inherit the rank's environment);
- ``launcher``: a process above the ranks (torchrun, mp.spawn's parent...), rank "".
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from profagent.contracts import ROLE_LAUNCHER, Placement, ProcessInfo, ProcessTree
from profagent.errors import UserError
from profagent.labels import shorten
from profagent.logs import LogOnce
from profagent.system.procfs import (
    PROC,
    boot_time,
    children_map,
    read_argv,
    read_children,
    read_environ,
    read_identity,
)
from profagent.target.cmdline import label_cmdline
from profagent.target.jobid import JobId, resolve_job_id, torchrun_args
from profagent.target.placement import placement_of
from profagent.target.ranks import Seen, classify, started_by
from profagent.target.tree import CMDLINE_MAX, rank_from_env

log = logging.getLogger(__name__)

# psutil's children(recursive=True) reads /proc/*/stat of every process on the node (its
# parent map): 2-15 ms a tick on a node with hundreds of processes. Between full scans, the
# tree is walked from /proc/PID/task/PID/children of the processes already known; a child
# started by another thread than its parent's main one is found at the next full scan.
FULL_SCAN_EVERY = 10.0
# A process younger than this may not have exec'd yet: between fork and exec it shows its
# parent's environment and command line (a rank caught there looked like a second launcher,
# for good). Its reads are used but not cached until it is this old.
SETTLED_AFTER = 2.0

Known = dict[int, tuple[int, float]]  # pid -> (ppid, create_time) of live, non-zombie processes


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
        clock: Callable[[], float] = time.monotonic,
        children_reader: Callable[[Path, int], list[int] | None] = read_children,
        wall: Callable[[], float] = time.time,
        host: str | None = None,
    ) -> None:
        self.pid = pid
        self.host = socket.gethostname() if host is None else host  # of HOST:PID, where nothing names the job
        self._clock = clock
        self._wall = wall
        self._read_children = children_reader
        self._full_scan_at: float | None = None
        self._cmdlines: dict[tuple[int, float], str] = {}  # (pid, create_time) -> label
        self.cmdline_args = cmdline_args  # agent.cmdline_args: arguments in the label (redacted)
        self.proc_root = Path(proc_root)
        self._read_environ = environ_reader
        # (pid, create_time, cmdline): a child read between fork and exec still shows its
        # parent's environment (no RANK yet); after exec its command line differs
        self._env_cache: dict[tuple[int, float, str], dict[str, str] | None] = {}
        self._known: dict[int, float] = {}  # pid -> create_time seen in the last tree
        self._job_id: str | None = None  # once named, for good
        self._argvs: dict[tuple[int, float], list[str]] = {}  # (pid, create_time) -> a launcher's arguments
        self._log_once = LogOnce(log)
        self._placements: dict[tuple[int, float], Placement] = {}  # (pid, create_time) -> placement
        self._booted: float | None = None  # boot time, read once
        self._starts: dict[tuple[int, float], str] = {}  # (pid, create_time) -> ranks.started_by
        self._reaping: set[tuple[int, float]] = set()  # processes seen catching SIGCHLD (for good)

    # -- discovery ---------------------------------------------------------------
    # One /proc/PID/stat read per process and tick tells whether it lives, its parent and
    # its start time; psutil objects cost three reads and their overhead for each.
    # Like psutil before, these read the real /proc; ``proc_root`` points the environment,
    # placement and children-file reads at a fixture (tests) or another root.
    def _identity(self, pid: int, create_time: float | None) -> tuple[int, float] | None:
        """(ppid, create_time) if ``pid`` lives (and is still the process started at
        ``create_time``), else None."""
        if self._booted is None:
            self._booted = boot_time(PROC)
        found = read_identity(PROC, pid, self._booted)
        if found is None or (create_time is not None and abs(found[1] - create_time) > 0.01):
            return None  # gone, a zombie, or the PID reused by an unrelated process
        return found

    def _collect(self, children: dict[int, list[int]] | None = None) -> Known:
        """The root and its descendants; if the root died, whatever we knew that lives on.
        ``children`` (ppid -> pids, read once for all targets) saves a walk of every
        process of the host for each target."""
        roots: Known = {}
        root = self._identity(self.pid, self._known.get(self.pid))
        if root is not None:
            roots[self.pid] = root
        else:
            roots = {pid: found for pid, ct in self._known.items() if (found := self._identity(pid, ct))}
        if children is not None:  # watch mode read the whole process table once for every job
            return self._full_scan(roots, children)
        now = self._clock()
        if self._full_scan_at is None or now - self._full_scan_at >= FULL_SCAN_EVERY:
            self._full_scan_at = now
            return self._full_scan(roots)
        walked = self._walk(roots)
        if walked is None:  # no children file here: full scans only
            self._full_scan_at = None
            return self._full_scan(roots)
        return walked

    def _full_scan(self, roots: Known, children: dict[int, list[int]] | None = None) -> Known:
        """The roots and all their descendants, from ``children`` (ppid -> pids) if given,
        else from a read of every process of the host."""
        if children is None:
            children = children_map(PROC)
        seen: Known = dict(roots)
        stack = [kid for pid in roots for kid in children.get(pid, ())]
        while stack:
            pid = stack.pop()
            if pid in seen or (found := self._identity(pid, None)) is None:
                continue
            seen[pid] = found
            stack.extend(children.get(pid, ()))
        return seen

    def _walk(self, roots: Known) -> Known | None:
        """The roots, every process known from the last tree that is still the same one,
        and their main threads' children, recursively; None if no children file reads."""
        seen: Known = dict(roots)
        for pid, create_time in self._known.items():
            if pid not in seen and (found := self._identity(pid, create_time)) is not None:
                seen[pid] = found
        todo, readable = list(seen), False
        while todo:
            kids = self._read_children(self.proc_root, todo.pop())
            if kids is None:
                continue
            readable = True
            for pid in kids:
                if pid not in seen and (found := self._identity(pid, None)) is not None:
                    seen[pid] = found
                    todo.append(pid)
        return seen if readable else None

    def _settled(self, create_time: float) -> bool:
        return self._wall() - create_time >= SETTLED_AFTER

    def _environ(self, pid: int, create_time: float, cmdline: str = "") -> dict[str, str] | None:
        key = (pid, create_time, cmdline)
        if key in self._env_cache:
            return self._env_cache[key]
        env = self._read_environ_once(pid)
        if self._settled(create_time):
            self._env_cache[key] = env
        return env

    def _read_environ_once(self, pid: int) -> dict[str, str] | None:
        try:
            return self._read_environ(self.proc_root, pid)
        except PermissionError:
            self._log_once(
                logging.WARNING, "environ",
                "cannot read /proc/%d/environ (permission denied): ranks and job id "
                "fall back to rank 0 / the launcher PID; run as the job's user or root",
                pid,
            )
        except OSError:
            pass
        return None

    # -- classification ------------------------------------------------------------
    def refresh(self, children: dict[int, list[int]] | None = None) -> ProcessTree:
        info: dict[int, tuple[int, float, str]] = {
            pid: (ppid, ct, self._cmdline(pid, ct)) for pid, (ppid, ct) in self._collect(children).items()
        }
        if not info:
            self._known = {}
            self._env_cache.clear()
            return ProcessTree(self._job_id or f"{self.host}:{self.pid}", self.pid, (), alive=False)

        envs = {pid: self._environ(pid, ct, cmd) or {} for pid, (_, ct, cmd) in info.items()}
        self._env_cache = {k: v for k, v in self._env_cache.items() if info.get(k[0], (0, 0.0, None))[1:] == k[1:]}
        seen = {pid: Seen(ppid, ct, envs[pid], self._started_by(pid, ct)) for pid, (ppid, ct, _) in info.items()}
        roles = classify(seen, lambda pid: self._handles_sigchld(pid, info[pid][1]),
                         lambda pid: self._torchrun(pid, info[pid][1]))
        out = [ProcessInfo(pid, info[pid][0], info[pid][1], r.role, r.rank, r.local_rank, r.world_size, info[pid][2])
               for pid, r in roles.items()]
        self._known = {p.pid: p.create_time for p in out}
        self._cmdlines = {k: v for k, v in self._cmdlines.items() if k[0] in self._known}
        self._placements = {k: v for k, v in self._placements.items() if k[0] in self._known}
        self._argvs = {k: v for k, v in self._argvs.items() if k[0] in self._known}
        self._starts = {k: v for k, v in self._starts.items() if k[0] in self._known}
        self._reaping = {k for k in self._reaping if k[0] in self._known}
        job_id = self._resolve_job_id(out, envs).value
        processes = tuple(
            dataclasses.replace(p, job_id=job_id, placement=self._placement(p, envs.get(p.pid, {}))) for p in out
        )
        return ProcessTree(job_id, self.pid, processes, alive=True)

    def _cmdline(self, pid: int, create_time: float) -> str:
        """The command-line label, read once per settled process (reading it every tick
        was a third of the refresh)."""
        key = (pid, create_time)
        label = self._cmdlines.get(key)
        if label is None:
            label = _short_cmdline(pid, self.cmdline_args)
            if self._settled(create_time):
                self._cmdlines[key] = label
        return label

    def _placement(self, proc: ProcessInfo, environ: dict[str, str]) -> Placement:
        key = (proc.pid, proc.create_time)
        found = self._placements.get(key)
        if found is None:
            found = self._placements[key] = placement_of(self.proc_root, proc.pid, environ)
        return found

    @property
    def job_id_named(self) -> bool:
        """Whether the job id names the job (from the environment or torchrun's command
        line), not the ``HOST:PID`` fallback that a rank's id may still replace."""
        return self._job_id is not None

    def _resolve_job_id(self, procs: list[ProcessInfo], envs: dict[int, dict[str, str]]) -> JobId:
        if self._job_id is not None:
            return JobId(self._job_id, True)
        argvs = {p.pid: self._argv(p) for p in procs if p.role == ROLE_LAUNCHER or p.pid == self.pid}
        found = resolve_job_id(procs, envs, argvs, self.pid, self.host)
        if found.named:
            self._job_id = found.value  # stable from now on
        return found

    def _argv(self, proc: ProcessInfo) -> list[str]:
        """A launcher's arguments (torchrun's names the job), read once it has settled."""
        key = (proc.pid, proc.create_time)
        argv = self._argvs.get(key)
        if argv is None:
            try:
                argv = read_argv(self.proc_root, proc.pid)
            except OSError:
                argv = []
            if self._settled(proc.create_time):
                self._argvs[key] = argv
        return argv

    def _torchrun(self, pid: int, create_time: float) -> bool:
        """Whether a process is a torchrun launcher: before its ranks exist (a multi-node
        rendezvous waits for every node) it is the launcher, not a rank 0 that stands still."""
        stub = ProcessInfo(pid, 0, create_time, ROLE_LAUNCHER, "", "", "", "")
        return torchrun_args(self._argv(stub)) is not None

    def _started_by(self, pid: int, create_time: float) -> str:
        """How multiprocessing started a process (``ranks.started_by``), read once it has
        settled (before exec it shows its parent's command line)."""
        key = (pid, create_time)
        found = self._starts.get(key)
        if found is None:
            try:
                found = started_by(read_argv(self.proc_root, pid))
            except OSError:
                found = ""
            if self._settled(create_time):
                self._starts[key] = found
        return found

    def _handles_sigchld(self, pid: int, create_time: float) -> bool:
        """Whether the process catches SIGCHLD (/proc/PID/status SigCgt): torch's DataLoader
        sets a handler when it starts its workers; once seen, remembered."""
        key = (pid, create_time)
        if key in self._reaping:
            return True
        if catches_signal(self.proc_root, pid, signal.SIGCHLD):
            self._reaping.add(key)
            return True
        return False


def catches_signal(proc_root: Path, pid: int, signum: int) -> bool:
    """Whether the process has a handler for ``signum`` (SigCgt of /proc/PID/status);
    False where it cannot be read."""
    try:
        with open(proc_root / str(pid) / "status", encoding="ascii", errors="replace") as fh:
            for line in itertools.islice(fh, 80):  # SigCgt is about the 35th line
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1][-16:], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _short_cmdline(pid: int, with_args: bool = False) -> str:
    """The label of a process's command line ("" if it exited meanwhile)."""
    try:
        proc = psutil.Process(pid)
        parts = proc.cmdline()
        text = label_cmdline(parts, with_args) if parts else proc.name()
    except psutil.Error:
        return ""
    return shorten(text, CMDLINE_MAX)

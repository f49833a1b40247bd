"""Watch mode's target: every training job of the node, found by rules, in one tree.

``NodeTarget.refresh()`` has the same contract as ``Target.refresh()``, so one runtime
and one set of sources serve every job of the node. Discovery, roots, job ids, relabels,
grace, limits and users are described in docs/service.md (Watch mode).

Its work stays bounded whatever the node's users start (thousands of look-alike
processes): a root examined and not admitted is remembered by (PID, start time) and
looked at again only once it could pass; at most ``max_new_per_scan`` roots a scan,
round-robin across users; one read of /proc's process list per tick; at most 4 KiB of
each command line. A reload (SIGHUP) changes discovery only: watched jobs stay.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import pwd
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from profagent.config import WatchConfig
from profagent.contracts import ROLE_DATALOADER, ROLE_LAUNCHER, ProcessInfo, ProcessTree
from profagent.logs import LogOnce
from profagent.system.cgroup import slurm_identity, slurm_job_of_cgroup
from profagent.system.procfs import PROC, children_map, process_table, read_argv, read_environ
from profagent.target.pid import PidTarget
from profagent.target.ranks import MP_FORKSERVER, started_by
from profagent.target.tree import JOB_VARS, rank_from_env

log = logging.getLogger(__name__)

Key = tuple[int, float]  # (pid, create_time): a PID alone can be reused
# A new root whose job id is still HOST:PID (nothing names the job yet) is admitted only
# once it is this old: a launcher's ranks may bring TORCHELASTIC_RUN_ID a moment later,
# and the job id should not change under a running job.
SETTLE_SECONDS = 5.0
MAX_EXPIRED_PER_JOB = 4096  # expired ranks remembered per job (for /metrics to leave out)


@dataclass(frozen=True)
class Rules:
    """What makes a process a training process. An empty regex turns that rule off."""

    cmdline: re.Pattern[str] | None
    env_markers: tuple[tuple[str, str | None], ...]
    gpu_processes: bool

    @classmethod
    def from_config(cls, w: WatchConfig) -> Rules:
        markers = []
        for m in w.env_markers:
            name, sep, value = m.partition("=")
            markers.append((name.strip(), value if sep else None))
        return cls(re.compile(w.cmdline_regex) if w.cmdline_regex else None, tuple(markers), w.gpu_processes)

    def match_cmdline(self, cmdline: str) -> bool:
        return self.cmdline is not None and self.cmdline.search(cmdline) is not None

    def match_env(self, env: dict[str, str]) -> bool:
        for name, value in self.env_markers:
            found = env.get(name)
            if found and (value is None or found == value):
                return True
        return False


@dataclass(frozen=True)
class Limits:
    max_jobs: int = 16
    max_processes_per_job: int = 256
    grace_seconds: float = 30.0
    scan_interval: float = 2.0
    max_jobs_per_user: int = 0  # 0: half of max_jobs, at least 1
    max_new_per_scan: int = 32  # roots examined (their trees built) per scan
    rank_expiry_seconds: float = 60.0

    @classmethod
    def from_config(cls, w: WatchConfig) -> Limits:
        return cls(w.max_jobs, w.max_processes_per_job, w.grace_seconds, w.scan_interval, w.max_jobs_per_user,
                   w.max_new_per_scan, w.rank_expiry_seconds)

    @property
    def per_user(self) -> int:
        return self.max_jobs_per_user or max(1, self.max_jobs // 2)


@dataclass
class _Root:
    target: PidTarget
    tree: ProcessTree | None = None
    uid: int = -1  # real uid of the root process: part of the job's identity
    trusted: bool = False  # its Slurm job id is vouched for by slurmd's cgroup, or SLURM_JOB_USER is its owner


class NodeTarget:
    """Discovers the node's training jobs and merges them into one ``ProcessTree``.

    ``gpu_pids`` returns the PIDs holding a GPU context (from the gpu source's last tick;
    no NVML call happens here); None when the gpu source is off. Everything read from
    the OS is injectable: ``proc_root``, ``environ_reader``, ``clock``, ``self_pid``.
    """

    def __init__(
        self,
        rules: Rules,
        limits: Limits,
        *,
        gpu_pids: Callable[[], Iterable[int]] | None = None,
        proc_root: str | Path = PROC,
        environ_reader: Callable[[Path, int], dict[str, str]] = read_environ,
        clock: Callable[[], float] = time.monotonic,
        self_pid: int | None = None,
        settle_seconds: float = SETTLE_SECONDS,
        cmdline_args: bool = False,
        host: str | None = None,
    ) -> None:
        self.cmdline_args = cmdline_args
        self.host = host  # of HOST:PID job ids (None: this host's name)
        self.proc_root = Path(proc_root)
        self._read_environ = environ_reader
        self._clock = clock
        self._self_pid = os.getpid() if self_pid is None else self_pid
        self._gpu_pids = gpu_pids
        self._settle = settle_seconds
        self._lock = threading.Lock()
        self._rules, self._limits = rules, limits
        self._roots: dict[Key, _Root] = {}
        self._ignored: dict[Key, tuple[int, str]] = {}  # roots left out by a limit -> (uid, job id)
        # roots too young for a PID job id -> (when to look again, their tree's size then)
        self._settling: dict[Key, tuple[float, int]] = {}
        self._uids: dict[Key, int] = {}  # owner of each candidate root (round-robin across users)
        self._loose_rank: dict[Key, bool] = {}  # has a rank but no job id variable (a custom launcher's)
        self._backlog_logged = False
        self._claims: dict[str, tuple[int, bool]] = {}  # job id -> (uid, trusted) of the owner of the plain id
        self._env_match: dict[tuple[int, float, str], bool] = {}
        self._ended: dict[str, float] = {}  # job id -> when its last process went
        self._alive_jobs: set[str] = set()
        self._labels: dict[Key, str] = {}  # each root's job label last tick (to tell a relabel from an end)
        self._capped = LogOnce(log)  # one max_processes_per_job line per job
        self._rank_seen: dict[str, dict[str, float]] = {}  # job id -> rank -> when a process of it was last seen
        self._expired: dict[str, dict[str, None]] = {}  # job id -> ranks expired (oldest first, bounded)
        self._last_scan: float | None = None
        self._reconfigured = False
        self.last_refresh: float | None = None  # clock() of the last complete refresh

    # -- configuration ---------------------------------------------------------------
    def reconfigure(self, rules: Rules, limits: Limits) -> None:
        """New rules and limits, used from the next refresh on (thread-safe)."""
        with self._lock:
            self._rules, self._limits = rules, limits
            self._reconfigured = True  # applied by the next refresh, on the runtime's thread

    def set_gpu_pids(self, gpu_pids: Callable[[], Iterable[int]] | None) -> None:
        """Where the gpu_processes rule gets its PIDs (the gpu source, once built)."""
        self._gpu_pids = gpu_pids

    @property
    def gpu_rule_active(self) -> bool:
        return self._gpu_pids is not None

    @property
    def jobs_watched(self) -> int:
        return len(self._alive_jobs)

    # -- the tick --------------------------------------------------------------------
    def refresh(self) -> ProcessTree:
        with self._lock:
            rules, limits, reconfigured = self._rules, self._limits, self._reconfigured
            self._reconfigured = False
        if reconfigured:
            self._last_scan = None  # scan again at once with the new rules
            self._ignored.clear()  # a larger max_jobs may admit them now
            self._settling.clear()
            self._env_match.clear()  # the markers may have changed
        now = self._clock()
        children = None
        if self._last_scan is None or now - self._last_scan >= limits.scan_interval:
            self._last_scan = now
            children = self._discover(rules, limits)
        if children is None and self._roots:
            children = children_map(self.proc_root)  # once per tick for every job, not once per job
        by_job: dict[str, list[ProcessTree]] = {}
        self._claim_trusted()
        relabelled: dict[str, str] = {}  # old job id -> new one, this tick
        for key, root in list(self._roots.items()):
            tree = root.target.refresh(children)
            if not tree.alive:
                del self._roots[key]
                continue
            root.tree = tree
            tree = self._own(tree, root.uid, root.trusted)
            before = self._labels.get(key)
            if before is not None and before != tree.job_id:
                relabelled[before] = tree.job_id
            self._labels[key] = tree.job_id
            by_job.setdefault(tree.job_id, []).append(tree)
        self._labels = {k: v for k, v in self._labels.items() if k in self._roots}

        for old, new in relabelled.items():
            if old in self._alive_jobs and old not in by_job:
                log.info("job %s is now job %s (its ranks name it): its series go on under the new id", old, new)
        for job_id in self._alive_jobs - set(by_job) - set(relabelled):
            self._ended[job_id] = now
            log.info("job %s ended; its series go in %.0fs", job_id, limits.grace_seconds)
        for job_id in by_job:
            self._ended.pop(job_id, None)
        self._ended = {j: t for j, t in self._ended.items() if now - t < limits.grace_seconds}
        self._alive_jobs = set(by_job)
        # an id stays claimed while its owner has a root with it, or while it is in its grace
        owned = {(r.tree.job_id, r.uid) for r in self._roots.values() if r.tree}
        self._claims = {j: c for j, c in self._claims.items() if (j, c[0]) in owned or j in self._ended}
        self._capped.forget(lambda job_id: job_id in self._alive_jobs)

        processes: list[ProcessInfo] = []
        for job_id in sorted(by_job):
            processes += self._cap(job_id, _merge(by_job[job_id]), limits.max_processes_per_job)
        jobs = [(j, True) for j in sorted(by_job)] + [(j, False) for j in sorted(self._ended)]
        expired = self._expire_ranks(processes, {j for j, _ in jobs}, now, limits.rank_expiry_seconds)
        self.last_refresh = self._clock()
        return ProcessTree("", 0, tuple(processes), alive=True, jobs=tuple(jobs), expired_ranks=expired)

    def _expire_ranks(self, processes: list[ProcessInfo], listed: set[str], now: float,
                      expiry: float) -> frozenset[tuple[str, str]]:
        """The (job, rank) pairs whose last process left more than ``expiry`` ago, in jobs
        still listed. A job that starts 50 short-lived ranks a second (each with a RANK of
        its own) once grew /metrics to 38,058 series in 230 s: an exited rank's series go
        ``expiry`` after it, not when its job ends. At most MAX_EXPIRED_PER_JOB are
        remembered per job (the sources have forgotten the older ones already)."""
        for p in processes:
            if p.rank:
                self._rank_seen.setdefault(p.job_id, {})[p.rank] = now
        self._rank_seen = {j: ranks for j, ranks in self._rank_seen.items() if j in listed}
        self._expired = {j: ranks for j, ranks in self._expired.items() if j in listed}
        for job_id, ranks in self._rank_seen.items():
            gone = [r for r, seen in ranks.items() if now - seen >= expiry]
            if not gone:
                continue
            mine = self._expired.setdefault(job_id, {})
            for rank in gone:
                del ranks[rank]
                mine.pop(rank, None)
                mine[rank] = None
            while len(mine) > MAX_EXPIRED_PER_JOB:
                del mine[next(iter(mine))]
        # a rank that comes back (a restarted worker with the same RANK) is not expired
        for p in processes:
            self._expired.get(p.job_id, {}).pop(p.rank, None)
        return frozenset((j, r) for j, ranks in self._expired.items() for r in ranks)

    def _claim_trusted(self) -> None:
        """A job whose Slurm id is vouched for (``_Root.trusted``) takes its plain id from a
        user who claimed it first without being vouched for (``SLURM_JOB_ID=12345`` set by
        hand before alice's job 12345 started): that one is relabelled ``12345@user``."""
        for root in self._roots.values():
            if root.tree is None or not root.trusted:
                continue
            claim = self._claims.get(root.tree.job_id)
            if claim is None or (not claim[1] and claim[0] != root.uid):
                if claim is not None:
                    log.warning("job id %s: the process of user %s that claimed it first is not in Slurm's job %s; "
                                "it is %s@%s from now on", root.tree.job_id, _user(claim[0]), root.tree.job_id,
                                root.tree.job_id, _user(claim[0]))
                self._claims[root.tree.job_id] = (root.uid, True)

    def _own(self, tree: ProcessTree, uid: int, trusted: bool = False) -> ProcessTree:
        """The tree under its job's label: the job id, suffixed with the user when another
        user already owns that id (roots are visited in admission order, vouched ones first:
        see _claim_trusted)."""
        owner = self._claims.setdefault(tree.job_id, (uid, trusted))[0]
        if owner == uid:
            return tree
        label = f"{tree.job_id}@{_user(uid)}"
        procs = tuple(dataclasses.replace(p, job_id=label) for p in tree.processes)
        return dataclasses.replace(tree, job_id=label, processes=procs)

    def _cap(self, job_id: str, procs: list[ProcessInfo], limit: int) -> list[ProcessInfo]:
        if len(procs) <= limit:
            return procs
        self._capped(
            logging.WARNING, job_id,
            "job %s has %d processes, over watch.max_processes_per_job = %d: exporting "
            "the first %d (launcher and ranks first); raise watch.max_processes_per_job",
            job_id, len(procs), limit, limit,
        )
        order = {ROLE_LAUNCHER: 0, ROLE_DATALOADER: 2}
        return sorted(procs, key=lambda p: (order.get(p.role, 1), p.pid))[:limit]

    # -- discovery -------------------------------------------------------------------
    def _discover(self, rules: Rules, limits: Limits) -> dict[int, list[int]]:
        """Find and admit new roots; returns the table's children map (for this tick)."""
        table = process_table(self.proc_root)
        children = _children(table)
        claimed = {p.pid for r in self._roots.values() if r.tree for p in r.tree.processes}
        claimed |= {k[0] for k in self._roots}
        gpu = set(self._gpu_pids() or ()) if rules.gpu_processes and self._gpu_pids else set()
        mine = _descendants(self._self_pid, children)

        live_env_keys = set()
        candidates: set[int] = set()
        for pid, (_, ct, cmdline) in table.items():
            if pid in mine or not cmdline:
                continue
            if rules.match_cmdline(cmdline) or pid in gpu:
                candidates.add(pid)
                continue
            if rules.env_markers and _is_python(cmdline):
                env_key = (pid, ct, cmdline)
                live_env_keys.add(env_key)
                if env_key not in self._env_match:
                    self._env_match[env_key] = rules.match_env(self._environ(pid))
                if self._env_match[env_key]:
                    candidates.add(pid)
        self._env_match = {k: v for k, v in self._env_match.items() if k in live_env_keys}

        def live(key: Key) -> bool:
            return table.get(key[0], (0, -1.0))[1] == key[1]

        self._ignored = {k: j for k, j in self._ignored.items() if live(k)}
        for cache in (self._settling, self._uids, self._loose_rank):
            for k in [k for k in cache if not live(k)]:
                del cache[k]

        roots = set()
        for pid in candidates - claimed:
            top = _topmost(pid, candidates, table)
            if top not in claimed:
                roots.add(top)
        known = {(r.uid, r.tree.job_id) for r in self._roots.values() if r.tree}
        wall = time.time()
        due: list[Key] = []
        for top in self._group_siblings(roots, table):
            key = (top, table[top][1])
            if top in claimed:
                continue
            settling = self._settling.get(key)
            if settling is not None and settling[0] > wall and settling[1] == len(_descendants(top, children)):
                continue  # too young, and no rank (with its job id) has appeared below it since
            if key in self._ignored and not _fits(self._ignored[key], known, limits):
                continue  # refused by a limit that still holds: not worth building its tree again
            due.append(key)
        batch = _round_robin(due, self._uid)
        for key in batch[: limits.max_new_per_scan]:
            self._admit(key, limits, children)
        backlog = len(batch) - limits.max_new_per_scan
        if backlog > 0 and not self._backlog_logged:
            log.warning("%d new candidate roots (most from user %s): examining %d per scan "
                        "(watch.max_new_per_scan), round-robin across users",
                        len(batch), _user(self._uid(batch[-1])), limits.max_new_per_scan)
        self._backlog_logged = backlog > 0
        return children

    def _group_siblings(self, roots: set[int], table: dict[int, tuple[int, float, str]]) -> set[int]:
        """Roots with a rank but no job id variable (SLURM_JOB_ID, TORCHELASTIC_RUN_ID: those
        group by id), or started by multiprocessing (mp.spawn's ranks, found by the GPU
        rule), that share a parent other than PID 1 become one root: the parent (above a
        forkserver, its parent: the launcher)."""
        by_parent: dict[int, list[int]] = {}
        for pid in roots:
            ppid = table[pid][0]
            if ppid <= 1 or ppid not in table or ppid == self._self_pid:
                continue
            key = (pid, table[pid][1])
            loose = self._loose_rank.get(key)
            if loose is None:  # the environment and command line of an exec'd process never change
                env = self._environ(pid)
                loose = self._loose_rank[key] = (rank_from_env(env) is not None
                                                 and not any(env.get(v) for v in JOB_VARS)) or self._started_by(pid) != ""
            if loose:
                by_parent.setdefault(ppid, []).append(pid)
        out = set(roots)
        for parent, kids in by_parent.items():
            if len(kids) >= 2:
                out.difference_update(kids)
                grand = table[parent][0]
                forkserver = grand > 1 and grand in table and grand != self._self_pid and self._started_by(parent) == MP_FORKSERVER
                out.add(grand if forkserver else parent)
        return out

    def _started_by(self, pid: int) -> str:
        try:
            return started_by(read_argv(self.proc_root, pid))
        except OSError:
            return ""

    def _uid(self, key: Key) -> int:
        uid = self._uids.get(key)
        if uid is None:
            try:
                uid = (self.proc_root / str(key[0])).stat().st_uid
            except OSError:
                uid = -1
            self._uids[key] = uid
        return uid

    def _admit(self, key: Key, limits: Limits, children: dict[int, list[int]] | None = None) -> None:
        target = PidTarget(key[0], self.proc_root, self._read_environ, cmdline_args=self.cmdline_args, host=self.host)
        tree = target.refresh(children)
        if not tree.alive:
            return
        age = time.time() - key[1]
        if not target.job_id_named and age < self._settle:
            # a launcher whose ranks (and their TORCHELASTIC_RUN_ID) may still come: look
            # again once it is old enough, not on every scan before
            self._settling[key] = (key[1] + self._settle, len(tree.processes))
            return
        self._settling.pop(key, None)
        uid = _owner(self.proc_root, key[0])
        if uid is None:
            return  # gone meanwhile
        job = (uid, tree.job_id)
        known = {(r.uid, r.tree.job_id) for r in self._roots.values() if r.tree}
        mine = {j for j in known if j[0] == uid}
        if job not in known and (len(known) >= limits.max_jobs or len(mine) >= limits.per_user):
            if job not in self._ignored.values():
                if len(known) >= limits.max_jobs:
                    log.warning(
                        "already watching %d jobs (watch.max_jobs = %d): ignoring job %s (PID %d) "
                        "until one ends; raise watch.max_jobs",
                        len(known), limits.max_jobs, tree.job_id, key[0],
                    )
                else:
                    log.warning(
                        "already watching %d jobs of user %s (watch.max_jobs_per_user = %d): ignoring "
                        "job %s (PID %d) until one ends; raise watch.max_jobs_per_user",
                        len(mine), _user(uid), limits.per_user, tree.job_id, key[0],
                    )
            self._ignored[key] = job
            return
        self._ignored.pop(key, None)
        if job not in known:
            log.info("attached to job %s of user %s (PID %d, %d processes)", tree.job_id, _user(uid), key[0], len(tree.processes))
        self._roots[key] = _Root(target, tree, uid, self._vouched(key[0], uid, tree.job_id))

    def _vouched(self, pid: int, uid: int, job_id: str) -> bool:
        return _slurm_claim_vouched(self.proc_root, pid, uid, job_id, self._environ(pid))

    def _environ(self, pid: int) -> dict[str, str]:
        try:
            return self._read_environ(self.proc_root, pid)
        except OSError:  # gone, or another user's without CAP_SYS_PTRACE/DAC_READ_SEARCH
            return {}


def _slurm_claim_vouched(proc_root: Path, pid: int, uid: int, job_id: str, environ: dict[str, str]) -> bool:
    """Whether ``job_id`` is the process' Slurm job by a word its user cannot forge for
    another user: slurmd's cgroup names that job; on a node without Slurm cgroups,
    SLURM_JOB_USER is the process' owner (a user can still name a job id of their own there)."""
    slurm = slurm_identity(environ)
    if slurm is None or slurm.job_id != job_id:
        return False
    in_cgroup = slurm_job_of_cgroup(proc_root, pid)
    if in_cgroup is not None:
        return in_cgroup == job_id
    return bool(slurm.user) and slurm.user == _user(uid)


def _owner(proc_root: Path, pid: int) -> int | None:
    """The real uid of a process (from /proc/PID/status), None if it is gone."""
    try:
        status = (proc_root / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    return None


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _is_python(cmdline: str) -> bool:
    """Whether argv[0] is a Python interpreter (python, python3.11, /opt/conda/bin/python...).

    The environment rule applies to Python processes only: a shell that exports
    PROFAGENT=1 (a batch script, srun) must not become a job of its own."""
    argv0 = cmdline.split(" ", 1)[0]
    return "python" in argv0.rsplit("/", 1)[-1]


def _fits(job: tuple[int, str], known: set[tuple[int, str]], limits: Limits) -> bool:
    """Whether a job refused by a limit would be admitted now."""
    if job in known:
        return True
    return len(known) < limits.max_jobs and sum(1 for j in known if j[0] == job[0]) < limits.per_user


def _round_robin(keys: list[Key], uid_of: Callable[[Key], int]) -> list[Key]:
    """One root of each user in turn (oldest first within a user)."""
    by_uid: dict[int, list[Key]] = {}
    for key in sorted(keys, key=lambda k: (k[1], k[0])):
        by_uid.setdefault(uid_of(key), []).append(key)
    return [k for turn in itertools.zip_longest(*by_uid.values()) for k in turn if k is not None]


def _children(table: dict[int, tuple[int, float, str]]) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(p)
    return children


def _descendants(pid: int, children: dict[int, list[int]]) -> set[int]:
    out, stack = {pid}, [pid]
    while stack:
        for c in children.get(stack.pop(), ()):
            if c not in out:
                out.add(c)
                stack.append(c)
    return out


def _topmost(pid: int, candidates: set[int], table: dict[int, tuple[int, float, str]]) -> int:
    """The highest candidate among ``pid`` and its ancestors."""
    top, seen = pid, {pid}
    cur = table[pid][0]
    while cur in table and cur not in seen:
        seen.add(cur)
        if cur in candidates:
            top = cur
        cur = table[cur][0]
    return top


def _merge(trees: list[ProcessTree]) -> list[ProcessInfo]:
    """The processes of one job's trees, each PID once."""
    seen: dict[int, ProcessInfo] = {}
    for tree in trees:
        for p in tree.processes:
            seen.setdefault(p.pid, p)
    return list(seen.values())

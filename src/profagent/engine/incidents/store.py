"""The incidents folder: where bundles live, how many are kept, and how they are read back.

``IncidentStore`` is one 0700 folder of bundles, bounded in count and bytes (the pure
``to_remove`` decides what goes); ``RateLimitFile`` keeps the gate's last captures across
restarts; ``find_incident`` reads one bundle back for the CLI (/api/incidents is
exporters/api/incidents.py, over ``IncidentStore.list``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import threading
import time
from pathlib import Path

import orjson

from profagent.analysis.incidents import TRIGGER_KINDS, Retention, Stored, to_remove
from profagent.config import IncidentsConfig
from profagent.engine.incidents.bundle import BundleMeta, safe_name
from profagent.errors import UserError
from profagent.sources.traces.watcher import default_state_dir
from profagent.system.safefs import read_nofollow, replace_nofollow

log = logging.getLogger(__name__)

RATE_LIMITS = "incidents-rate-limits.json"  # in the agent's state folder: survives restarts
MAX_RATE_LIMITS_BYTES = 1024 * 1024


def incidents_dir(config: IncidentsConfig, state_dir: str) -> Path:
    """incidents.dir, else <agent state folder>/incidents (/var/lib/profagent/incidents as root)."""
    return Path(config.dir) if config.dir else default_state_dir(state_dir) / "incidents"


def rate_limits_path(state_dir: str) -> Path:
    """<agent state folder>/incidents-rate-limits.json: the captures still inside their period."""
    return default_state_dir(state_dir) / RATE_LIMITS


def retention(config: IncidentsConfig) -> Retention:
    return Retention(config.max_count, config.max_bytes, config.max_count_per_job,
                     config.max_count_per_user, config.max_bytes_per_user)


# -- storage --------------------------------------------------------------------------------
class IncidentStore:
    """The incidents folder: one 0700 folder per incident, bounded in count and bytes."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def ensure_root(self) -> None:
        """Create the folder 0700 (parents too). Raises OSError if it is a symlink or not ours."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(self.root)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(f"{self.root} is not a folder owned by this user")
        os.chmod(self.root, 0o700)

    def create(self, kind: str, job_id: str, now: float) -> Path:
        """A new empty incident folder (mkdir fails on anything already there, symlinks too)."""
        self.ensure_root()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        base = f"{stamp}-{safe_name(job_id, 'job')[:40] or 'job'}-{kind}"
        for n in range(1000):
            path = self.root / (base if n == 0 else f"{base}-{n}")
            try:
                os.mkdir(path, 0o700)
                return path
            except FileExistsError:
                continue
        raise OSError(f"too many incidents named {base}")

    def list(self) -> list[BundleMeta]:
        """Every incident's metadata, oldest first (unreadable folders are skipped)."""
        out = []
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return []
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            try:
                meta = BundleMeta.read(Path(entry.path))
            except (OSError, ValueError):
                continue
            if meta is not None:
                out.append(meta)
        return sorted(out, key=lambda m: (m.time or 0.0, m.id))

    def prune(self, caps: Retention) -> list[str]:
        """Remove incidents beyond the caps (``to_remove``); returns the ids removed."""
        stored = [Stored(m.id, m.time or 0.0, _folder_bytes(self.root / m.id), m.job_id or "",
                         -1 if m.uid is None else m.uid) for m in self.list()]
        removed = to_remove(stored, caps)
        for incident_id in removed:
            shutil.rmtree(self.root / incident_id, ignore_errors=True)  # rmtree never follows symlinks
        return removed


def _folder_bytes(path: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            with contextlib.suppress(OSError):
                total += entry.stat(follow_symlinks=False).st_size
    return total


# -- the source ------------------------------------------------------------------------------

class RateLimitFile:
    """The gate's last captures, kept across restarts: a 0600 file in the state folder,
    written through a fresh temporary file (O_EXCL|O_NOFOLLOW) and read without following
    a symlink or waiting on a FIFO. A corrupt file is logged in one line and ignored."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()  # captures start from the tick and from control requests

    def load(self) -> dict[tuple[str, str], float]:
        try:
            data = orjson.loads(read_nofollow(self.path, MAX_RATE_LIMITS_BYTES))
            out = {(str(kind), str(job)): float(t) for kind, job, t in data["last"]
                   if kind in TRIGGER_KINDS and isinstance(t, int | float)}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, KeyError) as exc:
            log.warning("ignoring the incidents' rate-limit state %s (%s): limits start afresh", self.path, exc)
            return {}
        return out

    def save(self, last: dict[tuple[str, str], float]) -> None:
        entries = sorted(([k, j, t] for (k, j), t in last.items()), key=lambda e: -e[2])
        data = orjson.dumps({"last": entries})
        while len(data) > MAX_RATE_LIMITS_BYTES and entries:  # huge job ids: keep the newest
            entries = entries[: len(entries) // 2]
            data = orjson.dumps({"last": entries})
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with self._lock:
                replace_nofollow(self.path, data)
        except OSError as exc:
            log.warning("cannot save the incidents' rate-limit state to %s (%s): a restart forgets it", self.path, exc)


# -- reading (CLI) ---------------------------------------------------------------------------
def find_incident(store: IncidentStore, incident_id: str) -> BundleMeta:
    """The incident's metadata. Raises UserError when there is no such incident."""
    for meta in store.list():
        if meta.id == incident_id:
            return meta
    raise UserError(f"no incident {incident_id!r} in {store.root}", "see `profagent incidents list`")

"""Kineto's on-demand daemon protocol (the one dynolog speaks), as pure functions.

A PyTorch process started with ``KINETO_USE_DAEMON=1`` polls a daemon about every 5 s
over an AF_UNIX datagram socket. Each datagram is a header ``{uint64 size; char
type[32]}`` followed by ``size`` payload bytes. The process sends ``req`` with
``{int32 type; int32 n; int64 jobid; int32 pids[n]}`` (``pids``: itself, then its
ancestors; ``type`` bit 2 = it can start an activity trace now); the daemon answers
``req`` with config text (empty = nothing to do). Older libkineto may send ``ctxt``
``{int32 gpu; int32 pid; int64 jobid}`` and expect ``ctxt`` with an int32 count.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from profagent.errors import SourceError

HEADER = struct.Struct("<Q32s")  # 40 bytes on x86-64, as libkineto lays it out
REQ_HEAD = struct.Struct("<iiq")
CTXT = struct.Struct("<iiq")
MAX_PIDS = 1024
DAEMON_NAME = "dynolog"
ACTIVITIES = 2  # bit in the request type: the process can start an activity trace
# Each process binds "dynoconfigclient" + a 36-character UUID in KINETO_IPC_SOCKET_DIR, and
# libkineto does not check that "<dir>/<name>" fits a socket path (107 bytes and a NUL).
CLIENT_NAME_BYTES = len("dynoconfigclient") + 36
SOCKET_PATH_MAX = 107
MAX_SOCKET_DIR_BYTES = SOCKET_PATH_MAX - 1 - CLIENT_NAME_BYTES  # 54
SOCKET_DIR_FIX = (f"set ondemand.socket_dir, and the jobs' KINETO_IPC_SOCKET_DIR, to a folder of at most "
                  f"{MAX_SOCKET_DIR_BYTES} bytes")


def socket_dir_problem(socket_dir: str) -> str | None:
    """Why processes cannot poll a daemon whose sockets are in ``socket_dir``, or None (also
    for "": the abstract namespace has no folder)."""
    size = len(socket_dir.encode(errors="surrogateescape"))
    if size <= MAX_SOCKET_DIR_BYTES:
        return None
    return (f"the Kineto socket folder is {size} bytes long: a job's socket in it (\"dynoconfigclient\" and a UUID) "
            f"would pass the {SOCKET_PATH_MAX}-byte limit of a socket path, so no job could poll")


class MalformedDatagram(SourceError, ValueError):
    """A datagram that does not follow the protocol; ``reason`` is a bounded label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}", reason)


@dataclass(frozen=True)
class Poll:
    """A ``req`` from a traced process."""

    type: int
    jobid: int
    pids: tuple[int, ...]  # the process itself first, then its ancestors

    @property
    def pid(self) -> int:
        return self.pids[0]

    @property
    def can_trace(self) -> bool:
        return bool(self.type & ACTIVITIES)


@dataclass(frozen=True)
class Context:
    """A ``ctxt`` from an older libkineto."""

    gpu: int
    pid: int
    jobid: int


def encode(kind: str, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind.encode()) + payload


def decode(datagram: bytes) -> Poll | Context:
    """Parse one datagram. Raises MalformedDatagram for anything off-protocol."""
    if len(datagram) < HEADER.size:
        raise MalformedDatagram("short", f"{len(datagram)} bytes, header needs {HEADER.size}")
    size, raw_kind = HEADER.unpack_from(datagram)
    payload = datagram[HEADER.size :]
    if size != len(payload):
        raise MalformedDatagram("size", f"header says {size} bytes, payload has {len(payload)}")
    kind = raw_kind.split(b"\0", 1)[0]
    if kind == b"req":
        if len(payload) < REQ_HEAD.size:
            raise MalformedDatagram("req", "payload shorter than its fixed part")
        rtype, n, jobid = REQ_HEAD.unpack_from(payload)
        if not 1 <= n <= MAX_PIDS or len(payload) != REQ_HEAD.size + 4 * n:
            raise MalformedDatagram("req", f"bad pid count {n}")
        pids = struct.unpack_from(f"<{n}i", payload, REQ_HEAD.size)
        if pids[0] <= 0:
            raise MalformedDatagram("req", f"bad pid {pids[0]}")
        return Poll(rtype, jobid, tuple(pids))
    if kind == b"ctxt":
        if len(payload) != CTXT.size:
            raise MalformedDatagram("ctxt", f"payload of {len(payload)} bytes")
        return Context(*CTXT.unpack(payload))
    raise MalformedDatagram("type", f"unknown message type {kind[:32]!r}")


def encode_poll(poll: Poll) -> bytes:
    """The datagram a process sends (used by tests and fuzzers)."""
    payload = REQ_HEAD.pack(poll.type, len(poll.pids), poll.jobid) + struct.pack(f"<{len(poll.pids)}i", *poll.pids)
    return encode("req", payload)


def reply_config(config: str) -> bytes:
    return encode("req", config.encode())


def reply_context(count: int) -> bytes:
    return encode("ctxt", struct.pack("<i", count))


@dataclass(frozen=True)
class TraceOptions:
    """What a `profagent trace` asks for. Exactly one of duration_ms / iterations is set."""

    duration_ms: int = 500
    iterations: int = 0
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False


def config_text(log_file: str, options: TraceOptions, trace_id: str) -> str:
    """The KEY=VALUE config libkineto expects. It writes ``<log file stem>_<pid>.json``."""
    lines = [f"ACTIVITIES_LOG_FILE={log_file}", "PROFILE_START_TIME=0"]
    if options.iterations > 0:
        lines += [
            "PROFILE_START_ITERATION=0",
            "PROFILE_START_ITERATION_ROUNDUP=1",
            f"ACTIVITIES_ITERATIONS={options.iterations}",
            # else libkineto runs a timed trace of the default 500 ms when the process has
            # not stepped yet (see endpoint.RESEND_AFTER)
            "ACTIVITIES_DURATION_MSECS=0",
        ]
    else:
        lines.append(f"ACTIVITIES_DURATION_MSECS={options.duration_ms}")
    flags = {
        "PROFILE_REPORT_INPUT_SHAPES": options.record_shapes,
        "PROFILE_PROFILE_MEMORY": options.profile_memory,
        "PROFILE_WITH_STACK": options.with_stack,
        "PROFILE_WITH_FLOPS": options.with_flops,
        "PROFILE_WITH_MODULES": options.with_modules,
    }
    lines += [f"{k}={'true' if v else 'false'}" for k, v in flags.items()]
    lines.append(f"REQUEST_TRACE_ID={trace_id}")
    return "\n".join(lines)


def output_path(log_file: str, pid: int) -> str:
    """Where libkineto writes the trace of ``pid`` for ``ACTIVITIES_LOG_FILE=log_file``."""
    stem, dot, ext = log_file.rpartition(".")
    if not dot or "/" in ext:
        return f"{log_file}_{pid}.json"
    return f"{stem}_{pid}.{ext}"

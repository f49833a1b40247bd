"""Configuration: defaults < TOML file < PROFAGENT_* environment < command-line flags.

Every key lives in one dataclass below, with its default and its help text; the
reference in docs/configuration.md and ``profagent config`` are generated from them.
Top-level keys (``listen``, ``interval``...) belong to the agent; the others sit in a
table per source (``[gpu] backend = ...``). The environment variable of a key is
``PROFAGENT_`` + the dotted key in upper case with dots as underscores
(``gpu.backend`` -> ``PROFAGENT_GPU_BACKEND``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from profagent.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

# 9100-9999 is fully allocated in Prometheus' default port allocations (node_exporter
# 9100, dcgm-exporter 9400...). 19400 sits outside it and reads as "next to dcgm".
DEFAULT_PORT = 19400
MIN_INTERVAL = 0.1
MAX_INTERVAL = 3600.0  # intervals and windows: an hour (inf or 1e300 would overflow the loops)
MAX_SECONDS = 7 * 86400.0  # other durations (grace, stall, ring...)
LOG_LEVELS = ("debug", "info", "warning", "error")
ENV_PREFIX = "PROFAGENT_"


def _opt(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class AgentConfig:
    listen: str = _opt(f":{DEFAULT_PORT}", "HOST:PORT for /metrics and /healthz (empty host = all interfaces)")
    interval: float = _opt(1.0, "default collection interval of every source, seconds (>= 0.1)")
    web_config: str = _opt("", "exporter-toolkit web-config.yml for TLS and basic auth")
    log_level: str = _opt("info", "debug, info, warning or error")
    exit_grace: float = _opt(3.0, "seconds attach keeps serving after the whole target tree is gone")
    state_dir: str = _opt("", "folder for small state files (default: $XDG_STATE_HOME/profagent or /var/lib/profagent as root)")
    max_label_bytes: int = _opt(128, "longest label value taken from a job's environment (job id, rank, Slurm and pod names), in bytes (>= 32); a longer value keeps its start plus a hash of the whole, so distinct values stay distinct")
    max_series_per_job: int = _opt(5000, "series of one job in each source's families on /metrics; past it the job's highest ranks are left out, and profagent_series_dropped{job_id} says how many series were")
    cmdline_args: bool = _opt(False, "show arguments in the cmdline label (secret-looking values are redacted: --*key/token/secret/pass/cred/auth/jwt/bearer*, -p, NAME=VALUE with such a NAME, URL passwords); off: program and script only")


@dataclass
class HttpConfig:
    request_deadline: float = _opt(10.0, "seconds a client has to send a whole request (TLS handshake, headers and body) or to take a whole answer; keep-alive idle time counts")
    max_connections: int = _opt(256, "HTTP connections open at once; at the cap the one that has been sending its request longest is closed (one that has begun a request before one that has sent nothing yet)")
    max_connections_per_client: int = _opt(16, "HTTP connections open at once from one client address (an IPv6 client: its /64)")
    workers: int = _opt(4, "threads that compute answers; requests are read without them, scrapes first")
    auth_backoff_max: float = _opt(5.0, "a failed basic-auth login holds that client's failing answers 0.1 s, doubling per failure up to this; a correct password is never refused (0 = no delay)")


@dataclass
class HostConfig:
    enabled: bool = _opt(True, "per-rank CPU, memory, threads, fds, IO and context switches (psutil)")
    interval: float = _opt(0.0, "seconds between samples; 0 = the agent interval")


@dataclass
class GpuConfig:
    backend: str = _opt("nvml", "nvml, off, or simulated[:PROFILE[xN]] (e.g. simulated:h100x8); simulated is never chosen automatically")
    gpus: str = _opt("", "comma-separated device indices to report (empty = all)")
    interval: float = _opt(0.0, "seconds between samples; 0 = the agent interval")


@dataclass
class StacksConfig:
    enabled: bool = _opt(True, "sample Python stacks of every rank with py-spy")
    rate: int = _opt(20, "samples per second per process at the full rate: a process's first warmup_seconds, a finding's first 5 minutes or a suspected stall in its job, and while `profagent top` or /api/stacks watches")
    window: float = _opt(5.0, "seconds per py-spy record window at the full rate (whole seconds); counters move once per window")
    steady_rate: int = _opt(4, "samples per second per process while its job is steady; 0 = always the full rate")
    steady_window: float = _opt(20.0, "seconds per py-spy record window while steady (each window starts a py-spy: fewer, longer windows cost less)")
    warmup_seconds: float = _opt(60.0, "a newly seen process is sampled at the full rate this long (one findings window)")
    nonblocking: bool = _opt(True, "sample without stopping the target (py-spy --nonblocking)")
    dataloader: bool = _opt(False, "also sample DataLoader worker processes all the time (a rank's workers are sampled anyway while its main thread stands still waiting for its DataLoader)")
    max_pyspy: int = _opt(16, "py-spy processes running at once (a record window and a periodic dump per sampled process); beyond it ranks are sampled in turn and each wait counts as reason pyspy_cap. An incident capture's dumps run at most this many at once too")
    top_k: int = _opt(10, "leaf functions kept per rank; the rest is folded into 'other'")
    stall_seconds: float = _opt(120.0, "a main-thread stack unchanged this long marks the rank stalled")
    native: bool = _opt(True, "read native (C++) frames with py-spy --native when a rank's stack stops moving and every native_every_seconds, to see collectives that run in C++ (DDP's reducer); a native window pauses the rank at each sample and costs ~0.6 s of CPU")
    native_every_seconds: float = _opt(300.0, "at most one periodic native window per rank this often (the first once the rank's stacks are steady); it teaches how much of each Python stack is a collective wait; 0 = only when a stall is suspected")
    ring_seconds: float = _opt(600.0, "seconds of stacks kept in memory for /api/stacks")
    interval: float = _opt(0.0, "seconds between publishing aggregates; 0 = the agent interval")


@dataclass
class TracesConfig:
    dirs: list[str] = _opt([], "folders watched recursively for torch profiler traces (repeatable --trace-dir)")
    polling: bool = _opt(False, "poll the folders instead of inotify (network filesystems)")
    settle_seconds: float = _opt(0.5, "a .json.gz must keep its size this long before it is read")
    invalid_after: float = _opt(60.0, "seconds a trace may stay incomplete before it counts as invalid")
    incomplete_cpu_seconds: float = _opt(5.0, "CPU seconds the agent spends, over all its reads, on a trace that stays incomplete; past it the trace counts as invalid (reason cpu_budget)")
    max_file_bytes: int = _opt(2 * 1024**3, "traces larger than this, once uncompressed, are skipped (reason too_large; a file of exactly this size is read)")
    max_buffered_bytes: int = _opt(16 * 1024**2, "text of a trace held in memory at once: the metadata before the events, or one event, string or run of blanks; a trace that needs more is skipped (reason too_large_event)")
    max_inflated_bytes: int = _opt(512 * 1024**2, "text of one trace once uncompressed: beyond it the trace is skipped (reason too_large), at most this much inflated and decoded (CPU)")
    max_events: int = _opt(1_000_000, "events of one trace (any kind): beyond it the trace is skipped (reason too_many_events); with max_names and max_name_chars one trace costs at most about 256 MiB")
    max_names: int = _opt(16_384, "distinct event names, and distinct threads, of one trace: beyond it the trace is skipped (reason too_many_names)")
    max_name_chars: int = _opt(2_048, "characters kept of an event name (and a string pid or tid); a longer one is cut there and ends with '…'")
    top_k: int = _opt(10, "kernels and ops kept per rank; the rest is folded into 'other'")
    interval: float = _opt(0.0, "seconds between publishing newly analysed traces; 0 = 0.25 s (or the agent interval if shorter)")
    baseline: str = _opt("", "a trace file (or folder of one job's traces) that is every job's baseline for the step-time regression and the diff naming its causes (empty: each rank's first steady traces)")


@dataclass
class OndemandConfig:
    enabled: bool = _opt(True, "host Kineto's daemon endpoint so `profagent trace` works")
    socket_dir: str = _opt("", "use socket files in this folder instead of the abstract namespace (KINETO_IPC_SOCKET_DIR)")
    trace_dir: str = _opt("/tmp/profagent-ondemand", "where on-demand traces are written (must be under /tmp or KINETO_ONDEMAND_TRACE_DIR)")
    control_socket: str = _opt("", "Unix socket (0600) that `profagent trace` talks to (default: /run/profagent/control.sock as root, else $XDG_RUNTIME_DIR/profagent/control.sock)")
    periodic_minutes: float = _opt(0.0, "take a trace every N minutes, rotating through ranks; 0 = off")
    periodic_duration_ms: int = _opt(500, "length of each periodic trace, milliseconds")
    keep: int = _opt(10, "how many agent-requested traces to keep")
    max_pollers: int = _opt(4096, "processes kept in the registry of Kineto pollers; when full, a new one replaces the least recently seen process of the user holding the most")
    max_pollers_per_user: int = _opt(256, "processes of one user (by its kernel credentials) kept in the registry; a new one replaces that user's least recently seen, so one user's flood never refuses another user's job")
    interval: float = _opt(0.0, "seconds between registry updates; 0 = the agent interval")


@dataclass
class TimelineConfig:
    enabled: bool = _opt(True, "each rank's step time, stages (data wait, backward, optimizer) and collective arrivals from kernel uprobes on its libtorch: no trace, no code change; needs root with CAP_PERFMON and CAP_CHECKPOINT_RESTORE, see docs/timeline.md")
    window_seconds: float = _opt(60.0, "steps of the last N seconds give the step-time quantiles, steps per second and the arrival straggler")
    max_libraries: int = _opt(8, "distinct libtorch files probed at once for each user (each venv or container image is one), counted by the user whose process maps it; a file no observed process maps any more frees its slot, one that gives no probe takes none; more are skipped with one log line")
    ring_pages: int = _opt(64, "pages of each CPU's ring buffer of probe events (a power of 2); events that do not fit are counted as lost")
    flood_events: int = _opt(25_000, "probe events a second from one process above which its events are shed for 10 s (its figures miss them), so that it cannot crowd out other jobs' events; a training rank sends hundreds to a few thousand")
    history_steps: int = _opt(4096, "steps kept per rank for `profagent timeline`, /api/timeline and each incident's timeline.json (up to 1.5 KB a step of a DDP job with a few gradient buckets, 6 MB a rank at the default: 7 minutes of steps at 10 a second)")
    interval: float = _opt(0.0, "seconds between publishing the figures; 0 = the agent interval")


@dataclass
class FindingsConfig:
    enabled: bool = _opt(True, "evaluate findings (hang, straggler, leak...) every agent tick; see docs/diagnosis.md")
    window_seconds: float = _opt(60.0, "stack samples of the last N seconds decide the *_bound, straggler and compile_storm findings; keep it at least twice stacks.steady_window, or a steady rank has no judged samples between two of its windows")
    min_samples: int = _opt(40, "main-thread stack samples a rank needs in the window before a stack-based finding is judged")
    bound_ratio: float = _opt(0.3, "dataloader_bound / host_sync_bound / optimizer_bound: that category's share of the main thread (or of the traced step) above this")
    compile_ratio: float = _opt(0.2, "compile_storm: share of the main thread in torch.compile above this...")
    compile_grace_seconds: float = _opt(300.0, "...after the first N seconds of the rank (warm-up compilation is normal)")
    straggler_ratio: float = _opt(1.25, "straggler: a rank's traced step time above this times the median of the other ranks (in a job whose traces show a collective)")
    straggler_share: float = _opt(0.2, "straggler: a rank's share of samples in collectives this much (absolute) below the other ranks' median")
    hold_seconds: float = _opt(60.0, "straggler, *_bound, compile_storm: a finding stays active this long after its evidence was last seen, so one that sits on its threshold does not flap (never held through a hang, nor after its rank ended); 0 = no hold")
    straggler_confirm_seconds: float = _opt(10.0, "straggler: raised only once its evidence (arrivals, wait shares or traces) was found at every evaluation for this long, so one evaluation on the line names no one; then held for hold_seconds")
    contention_share: float = _opt(0.05, "straggler: a rank named from its stacks whose main thread waited for a CPU (run queue) this share of the window or more is said to be slowed by CPU contention on the node")
    arrival_last_share: float = _opt(0.6, "straggler from the kernel probes: a rank whose lags behind the first rank, added up over a step, were the most at at least this share of the job's steps over timeline.window_seconds...")
    arrival_lag_share: float = _opt(0.1, "...by lags behind the first rank that add up, over a step, to at least this share of it more than the other ranks' lags do (the median step; FSDP's per-layer collectives are each late by a slice of it)...")
    arrival_min_collectives: int = _opt(50, "...over this many matched collectives at least...")
    arrival_min_seconds: float = _opt(30.0, "...spanning this many seconds at least (a job's first seconds are uneven); where the probes match a job's collectives, they replace the stack wait shares as its straggler signal")
    min_steps: int = _opt(20, "dataloader_bound from the kernel probes: steps a rank needs in the window before its data-wait share is judged")
    stall_warning_seconds: float = _opt(30.0, "stall: a warning once every rank of a job has made no optimizer step for this long (kernel probes)...")
    stall_warning_factor: float = _opt(10.0, "...or this many times its p90 step time, if longer; it clears when steps resume, and a hang takes over at stacks.stall_seconds")
    gpu_idle_ratio: float = _opt(0.1, "gpu_idle: utilisation of a GPU the rank uses below this...")
    gpu_idle_seconds: float = _opt(60.0, "...for this long")
    gpu_errors_seconds: float = _opt(600.0, "gpu_errors: an XID or uncorrected ECC error keeps the finding active this long")
    leak_window_seconds: float = _opt(600.0, "memory_leak: history kept per rank to fit the growth")
    leak_min_span_seconds: float = _opt(120.0, "memory_leak: minimum history span before judging")
    leak_min_rate: float = _opt(64 * 1024.0, "memory_leak: growth below this many bytes per second is ignored")
    leak_horizon_seconds: float = _opt(4 * 3600.0, "memory_leak: warning when the growth exhausts available memory within this; critical within a quarter of it")


@dataclass
class IncidentsConfig:
    enabled: bool = _opt(True, "capture an incident bundle (stacks of every rank, findings, metrics, traces) when a rank hangs, a step time regresses, or on `profagent incidents capture`")
    dir: str = _opt("", "folder of incident bundles, one 0700 folder each (default: STATE_DIR/incidents, /var/lib/profagent/incidents as root)")
    max_count: int = _opt(20, "incidents kept; the oldest are removed first")
    max_bytes: int = _opt(512 * 1024**2, "total bytes of incidents kept; the oldest are removed first (the newest is always kept)")
    max_count_per_job: int = _opt(5, "incidents kept per job; its oldest are removed first (0 = no cap but max_count)")
    max_count_per_user: int = _opt(8, "incidents kept per user (the real uid of the job's processes): one user's incidents evict only that user's own (0 = no cap)")
    max_bytes_per_user: int = _opt(192 * 1024**2, "bytes of incidents kept per user; that user's oldest are removed first (0 = no cap)")
    max_captures: int = _opt(4, "captures running at once on the node (each ends by capture_timeout); one per job at a time")
    max_captures_per_user: int = _opt(1, "captures of one user's jobs running at once, so one user cannot hold every capture slot")
    rate_limit_seconds: float = _opt(900.0, "at most one incident per job and trigger kind (hang, regression, manual) in this many seconds")
    regression_factor: float = _opt(2.0, "a rank's trace step time above this multiple of its own recent baseline is a regression")
    regression_seconds: float = _opt(60.0, "...once it has stayed above for this many seconds (0 = at the first slow trace)")
    capture_timeout: float = _opt(60.0, "seconds a capture may take: py-spy dumps still running are killed and on-demand traces no longer waited for, then it writes what it has")


# Python running torchrun / torch.distributed.run|launch, or a script or module named *train*.
DEFAULT_WATCH_CMDLINE = (
    r"python[0-9.]*\s(.*[\s/])?(torchrun\b|-m\s+torch\.distributed\.(run|launch)\b"
    r"|[\w.-]*train[\w.-]*\.py\b|-m\s+[\w.]*train\b)"
)


@dataclass
class WatchConfig:
    cmdline_regex: str = _opt(DEFAULT_WATCH_CMDLINE, "`profagent watch` attaches to processes whose command line matches this regex (empty = rule off)")
    env_markers: list[str] = _opt(["PROFAGENT=1", "KINETO_USE_DAEMON"], "...or whose environment has one of these: NAME (set, non-empty) or NAME=VALUE")
    gpu_processes: bool = _opt(True, "...or that hold a GPU context according to NVML (needs the gpu source on)")
    grace_seconds: float = _opt(30.0, "seconds an ended job keeps profagent_target_up = 0 and its last counters before its series disappear")
    rank_expiry_seconds: float = _opt(60.0, "seconds a rank that exited keeps its series (its last counters) while its job goes on; then they go, so a job that starts short-lived ranks cannot grow /metrics for as long as it runs")
    max_jobs: int = _opt(16, "jobs watched at once; further jobs are ignored (one log line) until one ends")
    max_jobs_per_user: int = _opt(0, "jobs of one user (the job's launcher's owner) watched at once, so one user cannot fill max_jobs; 0 = half of max_jobs, at least 1")
    max_new_per_scan: int = _opt(32, "new candidate processes examined per scan, round-robin across users (so thousands of look-alike processes cannot stall discovery); the rest wait for the next scans")
    max_new_processes_per_user: int = _opt(16, "new processes of one user's watched jobs taken in per agent tick (a rank, a DataLoader worker: each costs /proc reads and a py-spy); the rest are taken in over the next ticks, so a user starting short-lived ranks by the dozen a second costs the agent a bounded amount")
    max_processes_per_job: int = _opt(256, "processes exported per job (launcher and ranks first); the rest are ignored (one log line)")
    scan_interval: float = _opt(2.0, "seconds between scans of /proc for new jobs (known jobs refresh every agent interval)")


SECTIONS: dict[str, type] = {
    "": AgentConfig,
    "http": HttpConfig,
    "host": HostConfig,
    "gpu": GpuConfig,
    "stacks": StacksConfig,
    "traces": TracesConfig,
    "ondemand": OndemandConfig,
    "timeline": TimelineConfig,
    "watch": WatchConfig,
    "findings": FindingsConfig,
    "incidents": IncidentsConfig,
}


@dataclass
class Config:
    agent: AgentConfig = field(default_factory=AgentConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    host: HostConfig = field(default_factory=HostConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    stacks: StacksConfig = field(default_factory=StacksConfig)
    traces: TracesConfig = field(default_factory=TracesConfig)
    ondemand: OndemandConfig = field(default_factory=OndemandConfig)
    timeline: TimelineConfig = field(default_factory=TimelineConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)
    findings: FindingsConfig = field(default_factory=FindingsConfig)
    incidents: IncidentsConfig = field(default_factory=IncidentsConfig)

    def section(self, name: str) -> Any:
        return getattr(self, name or "agent")

    def interval_of(self, section: str) -> float:
        """The effective interval of a source: its own, else the agent's."""
        own = getattr(self.section(section), "interval", 0.0) or 0.0
        return own if own > 0 else self.agent.interval


@dataclass(frozen=True)
class Key:
    dotted: str
    section: str
    name: str
    type: Any
    default: Any
    help: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dotted.upper().replace(".", "_")


def all_keys() -> list[Key]:
    keys = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            dotted = f"{section}.{f.name}" if section else f.name
            keys.append(Key(dotted, section, f.name, hints[f.name], default, f.metadata["help"]))
    return keys


def _suggest(name: str, known: list[str]) -> str:
    import difflib  # only for a mistyped key: its import is 30 ms of every agent's and command's start

    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'?" if close else "see docs/configuration.md for the known keys"


def _convert(key: Key, value: Any, origin: str) -> Any:
    """Coerce a file/env/flag value to the key's type; strings come from the environment."""
    typ = key.type
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        typ = next(a for a in typing.get_args(typ) if a is not type(None))
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if typing.get_origin(typ) is list:
            if isinstance(value, str):
                return [v for v in value.split(",") if v]
            if isinstance(value, (list, tuple)):
                return [str(v) for v in value]
            raise ValueError(value)
        if typ is int and isinstance(value, float):
            raise ValueError(value)
        if typ in (int, float) and isinstance(value, bool):
            raise ValueError(value)
        return typ(value)
    except (TypeError, ValueError):
        name = getattr(typ, "__name__", str(typ))
        raise UserError(
            f"invalid value {value!r} for '{key.dotted}' in {origin}", f"expected {name}"
        ) from None


def _apply(config: Config, key: Key, value: Any, origin: str) -> None:
    setattr(config.section(key.section), key.name, _convert(key, value, origin))


def _read_file(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise UserError(f"config file {path} not found", "check the --config path") from None
    except IsADirectoryError:
        raise UserError(f"config file {path} is a directory", "pass the config.toml file itself") from None
    except PermissionError:
        raise UserError(f"cannot read config file {path}", "fix its permissions") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read config file {path} ({exc})", "pass a readable TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"malformed config file {path} ({exc})", "fix the TOML syntax") from None


def _flatten(data: Mapping[str, Any], path: Path, by_dotted: dict[str, Key]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in data.items():
        if isinstance(value, dict) and name in SECTIONS:
            for sub, subvalue in value.items():
                flat[f"{name}.{sub}"] = subvalue
        else:
            flat[name] = value
    for dotted in flat:
        if dotted not in by_dotted:
            raise UserError(
                f"unknown config key '{dotted}' in {path}", _suggest(dotted, list(by_dotted))
            )
    return flat


def load_config(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the effective configuration. Raises UserError on any bad key or value."""
    keys = all_keys()
    by_dotted = {k.dotted: k for k in keys}
    by_env = {k.env: k for k in keys}
    config = Config()
    if path:
        path = Path(path)
        for dotted, value in _flatten(_read_file(path), path, by_dotted).items():
            _apply(config, by_dotted[dotted], value, str(path))
    for name, value in (env or {}).items():
        if not name.startswith(ENV_PREFIX):
            continue
        if name not in by_env:
            raise UserError(
                f"unknown environment variable {name}", _suggest(name, list(by_env))
            )
        _apply(config, by_env[name], value, f"${name}")
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        if dotted not in by_dotted:  # a programming error, not user input
            raise KeyError(dotted)
        _apply(config, by_dotted[dotted], value, "the command line")
    validate(config)
    return config


def parse_listen(listen: str) -> tuple[str, int]:
    """Split HOST:PORT (``:PORT`` = all interfaces, ``[::1]:PORT`` for IPv6)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UserError(f"invalid listen address {listen!r}", "use HOST:PORT, e.g. 127.0.0.1:19400")
    return host.strip("[]") or "0.0.0.0", int(port)


def validate(config: Config) -> None:
    parse_listen(config.agent.listen)
    if config.agent.log_level.lower() not in LOG_LEVELS:
        raise UserError(
            f"invalid log level {config.agent.log_level!r}", f"use one of {', '.join(LOG_LEVELS)}"
        )
    _check_numbers(config)
    for key in all_keys():
        if key.name == "interval":
            value = config.section(key.section).interval
            if value and value < MIN_INTERVAL:
                raise UserError(
                    f"'{key.dotted}' is {value}s, below the minimum", f"use at least {MIN_INTERVAL}s"
                )
    if config.agent.interval <= 0:
        raise UserError("'interval' must be positive", f"use at least {MIN_INTERVAL}s")
    if config.ondemand.max_pollers < 1 or config.ondemand.max_pollers_per_user < 1:
        raise UserError("'ondemand.max_pollers' and 'ondemand.max_pollers_per_user' must be at least 1",
                        "raise them, or set ondemand.enabled = false")
    if config.traces.max_buffered_bytes < 1024**2:
        raise UserError(f"'traces.max_buffered_bytes' is {config.traces.max_buffered_bytes}", "use 1 MiB (1048576) or more")
    t = config.traces
    for key, value, least in (("max_inflated_bytes", t.max_inflated_bytes, 1024**2), ("max_events", t.max_events, 1000),
                              ("max_names", t.max_names, 100), ("max_name_chars", t.max_name_chars, 64)):
        if value < least:
            raise UserError(f"'traces.{key}' is {value}", f"use {least} or more")
    if config.traces.incomplete_cpu_seconds <= 0:
        raise UserError("'traces.incomplete_cpu_seconds' must be positive", "use a few seconds, e.g. 5")
    if config.agent.max_series_per_job < 1:
        raise UserError(f"'max_series_per_job' is {config.agent.max_series_per_job}", "use 1 or more")
    if config.agent.max_label_bytes < 32:
        raise UserError(f"'max_label_bytes' is {config.agent.max_label_bytes}", "use 32 bytes or more")
    _validate_watch(config.watch)
    _validate_stacks(config.stacks)
    _validate_timeline(config.timeline)
    _validate_incidents(config.incidents)
    _validate_http(config.http)


def _validate_http(h: HttpConfig) -> None:
    if h.request_deadline < 0.5:
        raise UserError(f"'http.request_deadline' is {h.request_deadline}s, below the minimum", "use at least 0.5 s")
    for name, top in (("max_connections", 65536), ("max_connections_per_client", 65536), ("workers", 64)):
        if not 1 <= getattr(h, name) <= top:
            raise UserError(f"'http.{name}' is {getattr(h, name)}", f"use 1 to {top}")


def _validate_incidents(inc: IncidentsConfig) -> None:
    if inc.max_count < 1 or inc.max_bytes < 1:
        raise UserError("'incidents.max_count' and 'incidents.max_bytes' must be at least 1", "raise them, or set incidents.enabled = false")
    if inc.max_captures < 1 or inc.max_captures_per_user < 1:
        raise UserError("'incidents.max_captures' and 'incidents.max_captures_per_user' must be at least 1", "raise them, or set incidents.enabled = false")
    if inc.regression_factor <= 1:
        raise UserError(f"'incidents.regression_factor' is {inc.regression_factor}", "use a factor above 1, e.g. 2")
    for name in ("rate_limit_seconds", "regression_seconds", "capture_timeout"):
        if getattr(inc, name) < 0:
            raise UserError(f"'incidents.{name}' is negative", "use 0 or more seconds")


def _check_numbers(config: Config) -> None:
    """Every duration finite, not negative and bounded (NaN would spin a loop, inf overflow it)."""
    for key in all_keys():
        value = getattr(config.section(key.section), key.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value) or value < 0:
            raise UserError(f"'{key.dotted}' is {value}", "use a finite number, 0 or more")
        windowed = key.name.endswith("interval") or key.dotted == "stacks.window"
        limit = MAX_INTERVAL if windowed else MAX_SECONDS
        if isinstance(value, float) and value > limit:
            raise UserError(f"'{key.dotted}' is {value:g}s, above the maximum", f"use at most {limit:g}s")


def _validate_stacks(st: StacksConfig) -> None:
    if st.rate < 1 or st.rate > 1000:
        raise UserError(f"'stacks.rate' is {st.rate}", "use 1 to 1000 samples per second (--stack-rate)")
    if st.window < 1:
        raise UserError(f"'stacks.window' is {st.window}s, below the minimum", "use at least 1 s")
    if st.top_k < 1:
        raise UserError(f"'stacks.top_k' is {st.top_k}", "use 1 or more")
    if st.max_pyspy < 1:
        raise UserError(f"'stacks.max_pyspy' is {st.max_pyspy}", "use 1 or more (or --no-stacks)")


def _validate_timeline(t: TimelineConfig) -> None:
    if t.ring_pages < 1 or t.ring_pages > 4096 or t.ring_pages & (t.ring_pages - 1):
        raise UserError(f"'timeline.ring_pages' is {t.ring_pages}", "use a power of 2 from 1 to 4096, e.g. 64")
    if t.flood_events < 1000:
        raise UserError(f"'timeline.flood_events' is {t.flood_events}", "use 1000 or more, e.g. 25000")
    if t.max_libraries < 1:
        raise UserError("'timeline.max_libraries' must be at least 1", "set it to 1 or more, or timeline.enabled = false")
    if t.window_seconds < 1:
        raise UserError(f"'timeline.window_seconds' is {t.window_seconds}s", "use at least 1 s")
    if not 1 <= t.history_steps <= 1_000_000:
        raise UserError(f"'timeline.history_steps' is {t.history_steps}", "use 1 to 1000000 steps, e.g. 4096")


def _validate_watch(w: WatchConfig) -> None:
    try:
        re.compile(w.cmdline_regex)
    except re.error as exc:
        raise UserError(f"invalid 'watch.cmdline_regex' ({exc})", "fix the regular expression") from None
    for marker in w.env_markers:
        if not marker.partition("=")[0].strip():
            raise UserError(f"invalid 'watch.env_markers' entry {marker!r}", "use NAME or NAME=VALUE")
    if w.scan_interval < MIN_INTERVAL:
        raise UserError(f"'watch.scan_interval' is {w.scan_interval}s, below the minimum", f"use at least {MIN_INTERVAL}s")
    if w.grace_seconds < 0:
        raise UserError("'watch.grace_seconds' is negative", "use 0 or more seconds")
    if w.rank_expiry_seconds < 0:
        raise UserError("'watch.rank_expiry_seconds' is negative", "use 0 or more seconds")
    for name in ("max_jobs", "max_processes_per_job", "max_new_per_scan", "max_new_processes_per_user"):
        if getattr(w, name) < 1:
            raise UserError(f"'watch.{name}' must be at least 1", f"set watch.{name} to 1 or more")
    if w.max_jobs_per_user < 0:
        raise UserError("'watch.max_jobs_per_user' is negative", "set it to 1 or more, or 0 for half of watch.max_jobs")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def default_toml() -> str:
    """A commented TOML file with every key at its default (for /etc/profagent/config.toml)."""
    lines = ["# profagent configuration. Every key is shown at its default, commented out.", ""]
    current = None
    for key in all_keys():
        if key.section != current:
            current = key.section
            if current:
                lines += ["", f"[{current}]"]
        lines.append(f"# {key.help}")
        lines.append(f"# {key.name} = {_toml_value(key.default)}")
    return "\n".join(lines) + "\n"


def effective_toml(config: Config) -> str:
    """``config`` as a TOML file that ``load_config`` reads back to the same values (the
    agent's keys at the top, one table per section), for ``profagent config``."""
    import tomli_w  # the writer matching tomllib; only this command needs it

    doc: dict[str, Any] = {}
    for key in all_keys():
        value = getattr(config.section(key.section), key.name)
        (doc.setdefault(key.section, {}) if key.section else doc)[key.name] = value
    return tomli_w.dumps(doc)


def reference_markdown() -> str:
    """The table of every key, as in docs/configuration.md."""
    rows = ["| key | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for key in all_keys():
        default = _toml_value(key.default).replace("|", "\\|")
        rows.append(f"| `{key.dotted}` | `{key.env}` | `{default}` | {key.help} |")
    return "\n".join(rows) + "\n"

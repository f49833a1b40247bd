"""`profagent top`: a live terminal view of a whole training job, one row per rank.

Data comes from GET /api/ranks (and /api/stacks for the selected rank): over HTTP from a
running agent (``--url``), or from an agent run in this process (``--pid``), built by the
same function (exporters/api/ranks.py). The rendering functions below are pure over that JSON,
so they are tested without a terminal.
"""

from __future__ import annotations

import dataclasses
import os
import select
import sys
import termios
import threading
import time
import tty
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Protocol

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from profagent.analysis.stacks import CATEGORIES, parse_folded
from profagent.cli.client import ClientAuth, JsonClient
from profagent.labels import printable, printable_data

# One letter per stack category, so the bar reads without colour too (plain output).
CATEGORY_KEYS = {
    "forward": ("f", "green"), "backward": ("b", "cyan"), "optimizer": ("o", "blue"),
    "dataloader": ("d", "yellow"), "host_sync": ("s", "magenta"), "collective": ("c", "red"),
    "checkpoint_io": ("k", "bright_yellow"), "compile": ("j", "bright_magenta"),
    "idle": ("i", "bright_black"), "other": ("·", "white"),
}
SHORT_NAMES = {"dataloader": "data", "host_sync": "sync", "collective": "coll", "checkpoint_io": "ckpt",
               "optimizer": "optim", "backward": "bwd", "forward": "fwd"}
assert set(CATEGORY_KEYS) == set(CATEGORIES)
SORTS = ("rank", "state", "cpu", "mem", "gpu", "step")
BAR_WIDTH = 10
STACK_SECONDS = 12.0  # "current" stack: the last two or three py-spy windows
LOCAL_INTERVAL = 0.25  # host and stacks ticks of the agent `top --pid` runs for itself
SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


@dataclass(frozen=True)
class ViewState:
    """What the user chose with the keys."""

    sort: str = "rank"
    selected: int = 0  # row index in the sorted table
    detail: bool = False
    quit: bool = False


# -- formatting helpers ------------------------------------------------------------------
def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "" or n >= 10 else f"{n:.1f}{unit}"
        n /= 1024
    return "-"  # unreachable


def human_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1:
        return f"{s * 1000:.0f}ms"
    if s < 120:
        return f"{s:.1f}s" if s < 10 else f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.0f}h"


def category_bar(shares: dict[str, float], width: int = BAR_WIDTH) -> Text:
    """Shares as ``width`` cells, largest categories first, each cell a category's letter."""
    text = Text()
    if not shares:
        return Text("-".ljust(width))
    ordered = sorted(((s, c) for c, s in shares.items() if c in CATEGORY_KEYS), reverse=True)
    cells: list[str] = []
    # Largest remainder: every category with a share >= one cell gets at least its floor.
    exact = [(s * width, c) for s, c in ordered]
    counts = {c: int(x) for x, c in exact}
    left = width - sum(counts.values())
    for _, c in sorted(exact, key=lambda xc: -(xc[0] - int(xc[0])))[:left]:
        counts[c] += 1
    for _, c in ordered:
        cells += [c] * counts[c]
    for c in cells[:width]:
        letter, color = CATEGORY_KEYS[c]
        text.append(letter, style=color)
    return text


def legend() -> Text:
    text = Text("stacks:", style="dim", no_wrap=True, overflow="ellipsis")
    for cat, (letter, color) in CATEGORY_KEYS.items():
        text.append(" " + letter, style=color)
        text.append(f"={SHORT_NAMES.get(cat, cat)}", style="dim")
    return text


# -- pure rendering over the /api/ranks JSON --------------------------------------------
def step_seconds(row: dict[str, Any]) -> float | None:
    """The rank's step time: the kernel probes' p50 over their window, else the mean of
    its last profiler trace."""
    probed = (row.get("timeline") or {}).get("p50_seconds")
    return probed if probed is not None else (row.get("step") or {}).get("mean_seconds")


def sort_ranks(ranks: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Rows in display order: by rank number, or the worst first for the other keys."""
    def rank_no(r: dict[str, Any]) -> tuple[int, str]:
        return (int(r["rank"]), "") if str(r["rank"]).isdigit() else (1 << 30, str(r["rank"]))

    def gpu(r: dict[str, Any]) -> float:
        return (r.get("gpu") or {}).get("utilization_ratio") or 0.0

    keys: dict[str, Callable[[dict[str, Any]], Any]] = {
        "rank": rank_no,
        "state": lambda r: (r["state"] != "stalled", -(r.get("stalled_seconds") or 0), rank_no(r)),
        "cpu": lambda r: (-(r.get("cpu_percent") or 0.0), rank_no(r)),
        "mem": lambda r: (-(r.get("uss_bytes") or r.get("rss_bytes") or 0), rank_no(r)),
        "gpu": lambda r: (gpu(r), rank_no(r)),  # idle GPUs first: that is the problem
        "step": lambda r: (-(step_seconds(r) or 0.0), rank_no(r)),
    }
    return sorted(ranks, key=keys.get(key, rank_no))


def header(payload: dict[str, Any], job: dict[str, Any]) -> RenderableType:
    """Job id, world size, node, GPU summary, and the active findings."""
    line = Text()
    line.append("profagent top", style="bold")
    line.append(f"  job {job['job_id']}", style="bold cyan")
    if not job.get("alive", True):
        line.append(" (ended)", style="red")
    world = job.get("world_size")
    line.append(f"  world {world if world is not None else '?'}  ranks {len(job['ranks'])}  node {payload.get('node', '?')}")
    gpu = job.get("gpu")
    gpu_line = Text("GPU: ", style="dim")
    if gpu is None:
        gpu_line.append("none (gpu source off)", style="dim")
    else:
        names = ", ".join(n.replace("NVIDIA ", "") for n in gpu["names"]) or "?"
        gpu_line.append(f"{gpu['up']}/{gpu['count']} × {names}")
        if gpu.get("simulated"):
            gpu_line.append(" SIMULATED", style="yellow")
        if gpu.get("utilization_ratio") is not None:
            gpu_line.append(f"  util {gpu['utilization_ratio'] * 100:.0f}%")
        if gpu.get("memory_used_bytes") is not None and gpu.get("memory_total_bytes"):
            gpu_line.append(f"  mem {human_bytes(gpu['memory_used_bytes'])}/{human_bytes(gpu['memory_total_bytes'])}")
    off = [name for name, up in (job.get("sources") or {}).items() if not up]
    if off:
        gpu_line.append(f"  sources off: {', '.join(off)}", style="yellow")
    lines: list[RenderableType] = [line, gpu_line]
    findings = job.get("findings") or []
    if not findings:
        lines.append(Text("findings: none active", style="dim"))
    for f in findings[:4]:
        t = Text("! ", style=SEVERITY_STYLE.get(f["severity"], ""))
        where = f"rank {f['rank']}" if f.get("rank") is not None else "job"
        t.append(f"{f['finding']} ({where}): ", style=SEVERITY_STYLE.get(f["severity"], ""))
        t.append(str(f.get("summary", "")))
        t.no_wrap, t.overflow = True, "ellipsis"
        lines.append(t)
    if len(findings) > 4:
        lines.append(Text(f"  … {len(findings) - 4} more findings (GET /api/findings)", style="dim"))
    return Group(*lines)


def _state_cell(row: dict[str, Any], slow: frozenset[str] = frozenset()) -> Text:
    if row["state"] == "stalled":
        return Text(f"STALLED {human_seconds(row.get('stalled_seconds'))}", style="bold red")
    if str(row["rank"]) in slow:  # running, but the others wait for it
        return Text("SLOW", style="bold yellow")
    return Text("running", style="green")


def straggler_ranks(job: dict[str, Any]) -> frozenset[str]:
    """Ranks an active ``straggler`` finding of the job names."""
    return frozenset(str(f["rank"]) for f in job.get("findings") or []
                     if f.get("finding") == "straggler" and f.get("rank") is not None)


def _gpu_cell(row: dict[str, Any]) -> str:
    gpu = row.get("gpu")
    if not gpu:
        return "-"
    util = gpu.get("utilization_ratio")
    return f"{'-' if util is None else f'{util * 100:.0f}%'} {human_bytes(gpu.get('memory_bytes'))}"


def _mem_cell(row: dict[str, Any]) -> str:
    rss, uss = row.get("rss_bytes"), row.get("uss_bytes")
    return human_bytes(rss) if uss is None else f"{human_bytes(rss)}/{human_bytes(uss)}"


def rank_table(job: dict[str, Any], view: ViewState, interactive: bool = True) -> Table:
    """One row per rank, the rank number first. Fits 80 columns: the function column shrinks."""
    rows = sort_ranks(job["ranks"], view.sort)
    mark = {view.sort: " ▼"} if interactive else {}
    table = Table(box=None, pad_edge=False, padding=(0, 1), expand=True, header_style="bold")
    table.add_column("rank" + mark.get("rank", ""), justify="right", no_wrap=True, min_width=4)
    table.add_column("state" + mark.get("state", ""), no_wrap=True, min_width=7)
    table.add_column("stacks", no_wrap=True, width=BAR_WIDTH)
    table.add_column("cpu%" + mark.get("cpu", ""), justify="right", no_wrap=True)
    table.add_column("mem" + mark.get("mem", ""), justify="right", no_wrap=True)
    table.add_column("gpu" + mark.get("gpu", ""), justify="right", no_wrap=True)
    table.add_column("step" + mark.get("step", ""), justify="right", no_wrap=True)
    table.add_column("top function", no_wrap=True, overflow="ellipsis", ratio=1, min_width=8)
    slow = straggler_ranks(job)
    for i, r in enumerate(rows):
        cpu = r.get("cpu_percent")
        step = step_seconds(r)
        top = r.get("top_function") or "-"
        if r.get("top_function_share") is not None:
            top = f"{r['top_function_share'] * 100:.0f}% {top}"
        table.add_row(
            ("›" if interactive and i == view.selected else "") + str(r["rank"]), _state_cell(r, slow), category_bar(r.get("categories") or {}),
            "-" if cpu is None else f"{cpu:.0f}", _mem_cell(r), _gpu_cell(r), human_seconds(step), top,
            style="reverse" if interactive and i == view.selected else None,
        )
    return table


def steps_notes(job: dict[str, Any]) -> list[Text]:
    """A line per way of finding steps other than Optimizer.step, naming its ranks: the
    step column would otherwise say "-" or a figure from another boundary, silently."""
    by_note: dict[str, list[str]] = {}
    for r in job["ranks"]:
        note = (r.get("timeline") or {}).get("steps_note")
        if note:
            by_note.setdefault(str(note), []).append(str(r["rank"]))
    return [Text(f"step, rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}: {note}", style="yellow")
            for note, ranks in sorted(by_note.items())]


def main_stack(folded: str, pid: int | None) -> list[str]:
    """The main thread's most frequent stack in ``folded`` text, outermost first."""
    samples = [s for s in parse_folded(folded, pid or 0) if s.main]
    if not samples:
        return []
    counts: Counter[tuple[str, ...]] = Counter()
    for s in samples:
        counts[tuple(f"{f.name} ({f.file}:{f.line})" if f.file else f.name for f in s.frames)] += s.count
    return list(counts.most_common(1)[0][0])


def detail(row: dict[str, Any], folded: str | None, height: int = 12) -> RenderableType:
    """The selected rank: its top functions and its current main-thread stack."""
    title = Text(f"rank {row['rank']}", style="bold")
    title.append(f"  pid {row.get('pid')}  threads {row.get('threads') or '-'}  dataloader workers {row.get('workers', 0)}")
    parts: list[RenderableType] = [title]
    funcs = Table(box=None, pad_edge=False, padding=(0, 1), show_header=True, header_style="bold")
    funcs.add_column("share", justify="right", no_wrap=True, min_width=5)
    funcs.add_column("function (recent main-thread samples)", no_wrap=True, overflow="ellipsis")
    for f in (row.get("functions") or [])[:5]:
        funcs.add_row(f"{f['share'] * 100:.0f}%", f["function"])
    parts.append(funcs)
    parts.append(Text("current stack (main thread, innermost last):", style="bold"))
    if folded is None:
        parts.append(Text("  (no stacks: the stacks source is off or has not sampled this rank yet)", style="dim"))
    else:
        frames = [printable(frame) for frame in main_stack(folded, row.get("pid"))]
        if not frames:
            parts.append(Text("  (no main-thread samples in the last seconds)", style="dim"))
        keep = max(3, height - 8)
        if len(frames) > keep:
            parts.append(Text(f"  … {len(frames) - keep} outer frames", style="dim"))
        for frame in frames[-keep:]:
            parts.append(Text("  " + frame, no_wrap=True, overflow="ellipsis"))
    return Group(*parts)


def screen(payload: dict[str, Any], view: ViewState, folded: str | None = None,
           interactive: bool = True, height: int = 40) -> RenderableType:
    """The whole view: every job's header and rank table, the detail pane, and the key help.

    Every string of the payload (ranks, job ids, function names...) comes from the
    watched jobs: control characters are escaped here, before anything is drawn."""
    payload = printable_data(payload)
    parts: list[RenderableType] = []
    jobs = payload.get("jobs") or []
    if not jobs:
        parts.append(Text(f"profagent top  node {payload.get('node', '?')}: no job observed yet", style="bold"))
    selected_row = None
    for job in jobs:
        parts += [header(payload, job), Text(""), rank_table(job, view, interactive), *steps_notes(job)]
        if selected_row is None and job["ranks"]:
            rows = sort_ranks(job["ranks"], view.sort)
            selected_row = rows[min(view.selected, len(rows) - 1)]
    if interactive and view.detail and selected_row is not None:
        parts += [Text(""), detail(selected_row, folded, height - 6 - sum(len(j["ranks"]) for j in jobs))]
    parts.append(Text(""))
    parts.append(legend())
    if interactive:
        parts.append(Text("keys: ↑/↓ select  enter stack  s sort  q quit", style="dim"))
    return Group(*parts)


def selected_rank(payload: dict[str, Any], view: ViewState) -> dict[str, Any] | None:
    for job in payload.get("jobs") or []:
        rows = sort_ranks(job["ranks"], view.sort)
        if rows:
            return rows[min(view.selected, len(rows) - 1)]
    return None


def on_key(view: ViewState, key: str, rows: int) -> ViewState:
    """The view after one key press."""
    if key in ("q", "Q", "\x03"):
        return replace(view, quit=True)
    if key == "s":
        return replace(view, sort=SORTS[(SORTS.index(view.sort) + 1) % len(SORTS)])
    if key in ("up", "k"):
        return replace(view, selected=max(0, view.selected - 1))
    if key in ("down", "j"):
        return replace(view, selected=min(max(0, rows - 1), view.selected + 1))
    if key in ("enter", " "):
        return replace(view, detail=not view.detail)
    if key == "esc":
        return replace(view, detail=False)
    return view


# -- data feeds ----------------------------------------------------------------------------
class Feed(Protocol):
    def ranks(self) -> dict[str, Any]: ...
    def stacks(self, rank: str, job_id: str, seconds: float) -> str | None: ...
    def close(self) -> None: ...


class HttpFeed:
    """A running agent's /api/ranks and /api/stacks."""

    def __init__(self, url: str, auth: ClientAuth, timeout: float = 5.0) -> None:
        self.client = JsonClient(url, auth, timeout=timeout, reach_fix="check --url and that `profagent attach` runs")

    def ranks(self) -> dict[str, Any]:
        return self.client.get_json("/api/ranks", not_found=(
            f"{self.client.shown} has no /api/ranks", "upgrade that agent, or point --url at a profagent agent"))

    def stacks(self, rank: str, job_id: str, seconds: float) -> str | None:
        status, body = self.client.get("/api/stacks", {"rank": rank, "job": job_id, "seconds": f"{seconds:g}"})
        return body.decode(errors="replace") if status == 200 else None

    def close(self) -> None:
        pass


class LocalFeed:
    """An agent for one job run in this process (``top --pid``): no HTTP listener."""

    def __init__(self, job: Any, api: Any) -> None:
        self.job, self.api = job, api

    def ranks(self) -> dict[str, Any]:
        self.job.watched()  # top is watching: full-rate stacks
        return self.api.payload()

    def stacks(self, rank: str, job_id: str, seconds: float) -> str | None:
        from profagent.sources.stacks.source import StacksSource

        for source in self.job.sources:
            if isinstance(source, StacksSource):
                return source.folded(rank, seconds, job_id or None)
        return None

    def close(self) -> None:
        self.job.stop()


# -- the loops -------------------------------------------------------------------------------
def _first_payload(feed: Feed, wait: float, sleep: Callable[[float], None] = time.sleep,
                   clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """A payload with rates: the agent needs two host readings for CPU %, so ask again a
    little later when a rank has none yet (at most ``wait`` seconds)."""
    payload = feed.ranks()
    deadline = clock() + wait
    while clock() < deadline and _missing_rates(payload):
        sleep(0.1)
        payload = feed.ranks()
    return payload


def _missing_rates(payload: dict[str, Any]) -> bool:
    ranks = [r for j in payload.get("jobs") or [] for r in j["ranks"]]
    return not ranks or any(r.get("cpu_percent") is None or not r.get("categories") for r in ranks)


def print_once(feed: Feed, console: Console, wait: float) -> None:
    console.print(screen(_first_payload(feed, wait), ViewState(), interactive=False))


def print_repeated(feed: Feed, console: Console, interval: float, stop: threading.Event, wait: float) -> None:
    """Not a terminal: the same table again every ``interval`` seconds, with a time stamp."""
    payload = _first_payload(feed, wait)
    while True:
        console.print(Text(f"--- {time.strftime('%H:%M:%S')} ---", style="dim"))
        console.print(screen(payload, ViewState(), interactive=False))
        console.file.flush()
        if stop.wait(interval):
            return
        payload = feed.ranks()


_ESCAPES = {"\x1b[A": "up", "\x1b[B": "down", "\x1bOA": "up", "\x1bOB": "down"}


def parse_keys(data: str) -> list[str]:
    """Key names in what one read() returned (several keys can arrive at once)."""
    keys: list[str] = []
    i = 0
    while i < len(data):
        seq = data[i:i + 3]
        if seq in _ESCAPES:
            keys.append(_ESCAPES[seq])
            i += 3
        elif data[i] == "\x1b":
            if i + 1 < len(data) and data[i + 1] in "[O":  # another escape sequence: skip it
                j = i + 2
                while j < len(data) and not data[j].isalpha() and data[j] != "~":
                    j += 1
                i = j + 1
            else:
                keys.append("esc")
                i += 1
        elif data[i] in "\r\n":
            keys.append("enter")
            i += 1
        else:
            keys.append(data[i])
            i += 1
    return keys


@contextmanager
def cbreak_keys(stop: threading.Event) -> Iterator[list[str]]:
    """Keys typed on stdin (cbreak mode, read in a thread); the terminal is always restored."""
    keys: list[str] = []
    fd = sys.stdin.fileno()
    if not os.isatty(fd):
        yield keys
        return
    saved = termios.tcgetattr(fd)

    def read() -> None:
        while not stop.is_set():
            ready, _, _ = select.select([fd], [], [], 0.1)
            if not ready:
                continue
            data = os.read(fd, 64).decode(errors="replace")
            if not data:
                return
            keys.extend(parse_keys(data))

    tty.setcbreak(fd)
    thread = threading.Thread(target=read, name="profagent-top-keys", daemon=True)
    thread.start()
    try:
        yield keys
    finally:
        stop.set()
        thread.join(1.0)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run_live(feed: Feed, console: Console, interval: float, stop: threading.Event) -> None:
    """Full screen, refreshed every ``interval`` seconds and at each key press."""
    from rich.live import Live

    view = ViewState()
    payload = feed.ranks()
    folded: str | None = None
    dirty = True
    next_fetch = time.monotonic() + interval
    with cbreak_keys(stop) as keys, Live(console=console, screen=True, auto_refresh=False,
                                         redirect_stderr=False) as live:
        while True:
            rows = sum(len(j["ranks"]) for j in payload.get("jobs") or [])
            while keys:
                view = on_key(view, keys.pop(0), rows)
                dirty = True
            if view.quit or stop.is_set():
                return
            if time.monotonic() >= next_fetch:
                payload = feed.ranks()
                next_fetch = time.monotonic() + interval
                dirty = True
            if dirty:
                dirty = False
                row = selected_rank(payload, view) if view.detail else None
                folded = None
                if row is not None:
                    job_id = next((j["job_id"] for j in payload.get("jobs") or [] if row in j["ranks"]), "")
                    folded = feed.stacks(row["rank"], job_id, STACK_SECONDS)
                live.update(screen(payload, view, folded, height=console.height), refresh=True)
            stop.wait(0.05)


def local_feed(config: Any, pid: int) -> LocalFeed:
    """Start an agent for ``pid`` in this process (sources only: no HTTP, no control socket)."""
    import socket

    from profagent.engine.agent import Job
    from profagent.exporters.api.ranks import RanksApi
    from profagent.target import check_attachable

    check_attachable(pid)
    # Our own agent, for as long as top shows it: quick ticks, so the first screen has CPU
    # rates and a first look at each rank's stack within a second. A viewer captures no
    # incident bundles (nor creates their folder): that is the running agent's job.
    config = dataclasses.replace(
        config,
        host=dataclasses.replace(config.host, interval=config.host.interval or LOCAL_INTERVAL),
        stacks=dataclasses.replace(config.stacks, interval=config.stacks.interval or LOCAL_INTERVAL),
        incidents=dataclasses.replace(config.incidents, enabled=False),
    )
    job = Job(config, pid)
    job.start()
    return LocalFeed(job, RanksApi(lambda: [job.state.view()], socket.gethostname()))


def run_top(config: Any, pid: int | None, url: str | None, auth: ClientAuth, once: bool, interval: float,
            console: Console) -> None:
    """`profagent top`: live on a terminal, plain tables otherwise, one table with ``once``."""
    from profagent.engine.agent import install_stop_signals

    feed: Feed = HttpFeed(url, auth) if url is not None else local_feed(config, pid)  # type: ignore[arg-type]
    stop = threading.Event()
    restore = install_stop_signals(stop)
    # Our own agent has CPU rates and a first look at the stacks (a thread-state dump) within
    # a second; the py-spy windows fill the categories in after that.
    warmup = 3.0 if url is not None else 1.0
    try:
        if once:
            print_once(feed, console, warmup)
        elif console.is_terminal:
            run_live(feed, console, interval, stop)
        else:
            print_repeated(feed, console, interval, stop, warmup)
    finally:
        restore()
        feed.close()

"""Reading and analysing many traces at once: one process per core, a progress bar on a
terminal. ``profagent analyze`` and ``profagent diff`` of a folder use it.

Each trace is read and analysed in its own process (parse + analysis is CPU-bound
Python and numpy: threads would share one core under the GIL): a pool of one worker per
core but one, forked from this process, and this process itself; only the small report
comes back. One trace, or one core, is read in this process alone (no pool to start).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from profagent.analysis.trace.report import analyze
from profagent.contracts import TraceReport
from profagent.sources.traces.reader import TraceError, read_trace

PROGRESS_FROM = 4  # traces: below this a set reads too fast for a bar to help

Outcome = TraceReport | tuple[str, str]  # a report, or (message, reason) of a TraceError


def _one(path: Path, top_k: int, in_steps: bool, iteration_window: bool = False) -> Outcome:
    try:
        return analyze(read_trace(path), top_k, iteration_window=iteration_window, in_steps=in_steps)
    except TraceError as exc:
        return (str(exc), exc.reason)


def cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def analyse_all(files: Sequence[Path], top_k: int, in_steps: bool = False,
                progress: bool | None = None, iteration_window: bool = False) -> list[Outcome]:
    """One outcome per file, in the files' order. ``progress``: show a bar on standard
    error (default: when it is a terminal and there are PROGRESS_FROM files or more);
    ``iteration_window``: the traces were taken for N iterations (see ``find_steps``)."""
    workers = min(len(files), cores())
    if progress is None:
        progress = len(files) >= PROGRESS_FROM and sys.stderr.isatty()
    tick, stop = _progress(len(files)) if progress else (lambda: None, lambda: None)
    try:
        if workers <= 1:
            out = []
            for path in files:
                out.append(_one(path, top_k, in_steps, iteration_window))
                tick()
            return out
        return _pool_and_here(files, workers, tick, top_k, in_steps, iteration_window)
    finally:
        stop()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # read (and reported) by _one
        return 0


def _pool_and_here(files: Sequence[Path], workers: int, tick: Callable[[], None], top_k: int, in_steps: bool,
                   iteration_window: bool) -> list[Outcome]:
    """This process, whose core would otherwise wait, reads its share of the traces (by
    size, from the back of the list) while a pool of ``workers - 1`` processes reads the
    rest; then it takes the pool's traces that no worker has started, from the back (a
    future not yet started can be cancelled). One fewer process to fork, one hand-over per
    trace only for the pool's, and this process's caches are warm."""
    import gc
    from concurrent.futures import ProcessPoolExecutor, wait

    sizes = [_size(p) for p in files]
    share, mine, taken = sum(sizes) / workers, len(files), 0
    while mine > 1 and taken + sizes[mine - 1] / 2 <= share:
        mine -= 1
        taken += sizes[mine]
    results: dict[int, Outcome] = {}
    with ProcessPoolExecutor(max_workers=workers - 1) as pool:
        # The workers are forked at the first submit. The objects made so far (imported
        # modules) are frozen in them: a collection in a worker would otherwise write to
        # each object's header and copy its page.
        gc.freeze()
        try:
            futures = [pool.submit(_one, files[i], top_k, in_steps, iteration_window) for i in range(mine)]
        finally:
            gc.unfreeze()
        for future in futures:
            future.add_done_callback(lambda f: None if f.cancelled() else tick())
        for i in range(len(files) - 1, -1, -1):
            if i < mine and not futures[i].cancel():  # a worker has it, and every trace before it
                break
            results[i] = _one(files[i], top_k, in_steps, iteration_window)
            tick()
        wait(futures)
        for i, future in enumerate(futures):
            if not future.cancelled():
                results[i] = future.result()
    return [results[i] for i in range(len(files))]


def _progress(total: int) -> tuple[Callable[[], None], Callable[[], None]]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("reading traces"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True)
    task = bar.add_task("traces", total=total)
    bar.start()
    return (lambda: bar.advance(task)), bar.stop

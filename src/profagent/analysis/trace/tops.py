"""Top-K: ops by self CPU time, kernels by GPU time. Everything else folds into "other".

Self CPU time of an op = its duration minus the durations of the ops directly nested in
it on the same thread (as torch.profiler's "Self CPU"). Kernel time = the sum of the
kernel's durations (not a union: two streams running the same kernel count twice).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from profagent.analysis.trace.intervals import Merged, covered, unique
from profagent.analysis.trace.kinds import Classified
from profagent.analysis.trace.model import KERNEL
from profagent.labels import OTHER


@dataclass(frozen=True)
class Top:
    name: str
    time: float  # µs
    count: int


def _rank(names: list[str], times: np.ndarray, counts: np.ndarray, k: int) -> tuple[Top, ...]:
    present = np.flatnonzero(counts > 0)
    order = present[np.lexsort((present, -times[present]))]
    out = [Top(names[i], float(times[i]), int(counts[i])) for i in order[:k]]
    rest = order[k:]
    if len(rest):
        out.append(Top(OTHER, float(times[rest].sum()), int(counts[rest].sum())))
    return tuple(out)


def top_ops(c: Classified, k: int) -> tuple[Top, ...]:
    """Ops by self CPU time (µs), K largest then "other"."""
    t = c.trace
    ops, self_time = _self_times(c)
    n = len(t.names)
    names = t.name[ops]
    times = np.bincount(names, weights=np.maximum(self_time, 0.0), minlength=n)
    counts = np.bincount(names, minlength=n)
    return _rank(t.names, times, counts, k)


def totals_in_steps(c: Classified, steps: Merged) -> tuple[dict[str, float], dict[str, float]]:
    """(kernel name -> µs of GPU time, op name -> µs of self CPU time), counting only the
    kernels and ops that start inside ``steps`` (the union of the step spans): what a
    per-step comparison divides by the number of steps."""
    t = c.trace
    kernels = c.gpu[t.kind[c.gpu] == KERNEL]
    kernels = kernels[covered(steps, t.ts[kernels])]
    n = len(t.names)
    ktimes = np.bincount(t.name[kernels], weights=t.end[kernels] - t.ts[kernels], minlength=n)
    ops, self_time = _self_times(c)
    inside = covered(steps, t.ts[ops])
    otimes = np.bincount(t.name[ops][inside], weights=np.maximum(self_time[inside], 0.0), minlength=n)
    return ({t.names[i]: float(ktimes[i]) for i in np.flatnonzero(ktimes > 0).tolist()},
            {t.names[i]: float(otimes[i]) for i in np.flatnonzero(otimes > 0).tolist()})


def _op_tree(c: Classified) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The ATen ops sorted by (thread, start, longest first), with their starts, ends,
    threads and parents (an op's parent is the last earlier op of its thread still running
    at its start). Computed once per trace: self times and launching ops both use it."""
    tree = c.memo.get("op_tree")
    if tree is None:
        t = c.trace
        ops = c.cpu_ops
        start, end, thread = t.ts[ops], t.end[ops], t.thread[ops]
        order = np.lexsort((start - end, start, thread))
        starts, ends, thread = start[order], end[order], thread[order]
        tree = c.memo["op_tree"] = (ops[order], starts, ends, thread, _parents(starts, ends, thread))
    return tree


def _self_times(c: Classified) -> tuple[np.ndarray, np.ndarray]:
    """The ATen ops (event indexes, sorted by thread and start) and their self time, µs."""
    ops, starts, ends, _, parent = _op_tree(c)
    child = np.flatnonzero(parent >= 0)
    p = parent[child]
    self_time = ends - starts
    # ufunc.at subtracts in index order: the same rounding as walking the ops one by one
    np.subtract.at(self_time, p, np.minimum(ends[child], ends[p]) - starts[child])
    return ops, self_time


_JUMP_ROUNDS = 64  # vectorized rounds before finishing the (rare) deep chains in Python


def _parents(starts: np.ndarray, ends: np.ndarray, thread: np.ndarray) -> np.ndarray:
    """For ops sorted by (thread, start), the index of the last earlier op of the same
    thread with ``end > start`` (-1: none), i.e. the top of a walk's nesting stack.

    Pointer jumping: ``cand[j]`` starts at ``j - 1`` and every op between ``cand[j]`` and
    ``j`` ends by ``starts[j]``; while ``cand[j]`` ended too, jump to ``cand[cand[j]]``
    (whose skipped ops end by its start, which is no later)."""
    n = len(starts)
    cand = np.arange(-1, n - 1)
    if n:
        cand[np.flatnonzero(np.diff(thread)) + 1] = -1  # the first op of each thread
    todo = np.flatnonzero(cand >= 0)
    for _ in range(_JUMP_ROUNDS):
        todo = todo[ends[cand[todo]] <= starts[todo]]
        if not len(todo):
            return cand
        nxt = cand[cand[todo]]
        cand[todo] = nxt
        todo = todo[nxt >= 0]
    cand_l, ends_l, starts_l = cand.tolist(), ends.tolist(), starts.tolist()
    for j in todo.tolist():  # increasing: the candidates of earlier ops are final
        p, s = cand_l[j], starts_l[j]
        while p >= 0 and ends_l[p] <= s:
            p = cand_l[p]
        cand_l[j] = p
    return np.array(cand_l, dtype=np.int64)


def top_kernels(c: Classified, k: int) -> tuple[Top, ...]:
    """Kernels by summed GPU time (µs), K largest then "other"."""
    t = c.trace
    kernels = c.gpu[t.kind[c.gpu] == KERNEL]
    n = len(t.names)
    times = np.bincount(t.name[kernels], weights=t.end[kernels] - t.ts[kernels], minlength=n)
    counts = np.bincount(t.name[kernels], minlength=n)
    return _rank(t.names, times, counts, k)


@dataclass(frozen=True)
class KernelStats:
    name: str
    count: int
    total: float  # µs
    mean: float
    min: float
    max: float
    launched_by: str | None  # the op that launched most of its instances (None: no matched launch)


def launching_ops(c: Classified) -> np.ndarray:
    """Per GPU op (``c.gpu`` order): the name id of the innermost ATen op that encloses its
    runtime call on the call's thread (-1: unmatched launch, or a call outside any op).
    The runtime call is found through the correlation id (what the ``ac2g`` flows link)."""
    t = c.trace
    out = np.full(len(c.gpu), -1, dtype=np.int64)
    ops = c.cpu_ops
    if not len(ops) or not (c.gpu_launcher >= 0).any():
        return out
    ops, starts, ends, thread, parent = _op_tree(c)
    matched = np.flatnonzero(c.gpu_launcher >= 0)
    calls = c.gpu_launcher[matched]
    call_ts, call_thread = t.ts[calls], t.thread[calls]
    # the last op of the call's thread that starts at or before the call, then up its parents
    first = np.searchsorted(thread, call_thread, side="left")
    last = np.searchsorted(thread, call_thread, side="right")
    j = np.full(len(calls), -1, dtype=np.int64)
    for th in unique(call_thread).tolist():
        sel = call_thread == th
        lo, hi = int(first[sel][0]), int(last[sel][0])
        j[sel] = np.where(hi > lo, lo + np.searchsorted(starts[lo:hi], call_ts[sel], side="right") - 1, -1)
        j[sel & (j < lo)] = -1
    for _ in range(_JUMP_ROUNDS * 4):
        up = (j >= 0)
        up[up] = ends[j[up]] <= call_ts[up]
        if not up.any():
            break
        j[up] = parent[j[up]]
    found = j >= 0
    out[matched[found]] = t.name[ops[j[found]]]
    return out


def kernel_stats(c: Classified, names: list[str]) -> tuple[KernelStats, ...]:
    """count, total, mean, min, max and the launching op of the kernels named ``names``."""
    t = c.trace
    is_kernel = t.kind[c.gpu] == KERNEL
    kernels = c.gpu[is_kernel]
    if not len(kernels) or not names:
        return ()
    launcher = launching_ops(c)[is_kernel]
    ids = {n: i for i, n in enumerate(t.names)}
    dur = t.end[kernels] - t.ts[kernels]
    kname = t.name[kernels]
    out = []
    for n in names:
        sel = kname == ids.get(n, -1)
        if not sel.any():
            continue
        d = dur[sel]
        ops = launcher[sel]
        ops = ops[ops >= 0]
        top = None
        if len(ops):
            top = t.names[int(np.argmax(np.bincount(ops)))]
        out.append(KernelStats(n, int(sel.sum()), float(d.sum()), float(d.mean()), float(d.min()), float(d.max()), top))
    return tuple(out)

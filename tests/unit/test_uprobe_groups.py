"""Which probe groups the start-up sweep may remove (system/uprobes.py): only a group an
agent named for itself, whose agent is provably gone; never one that merely shares the
prefix, nor a live agent's (between its define and its open, the kernel would let it go).
A /proc tree of plain files stands in for the real one: each process's ``ns/pid`` inode
is its namespace, as on Linux."""

from __future__ import annotations

import os
from pathlib import Path

from profagent.system import uprobes


def _process(proc: Path, pid: int, start: int, namespace_of: Path | None = None) -> int:
    """A process in the fake /proc; returns its PID namespace's inode (its own file's, or
    that of ``namespace_of``'s namespace, which it then shares)."""
    (proc / str(pid) / "ns").mkdir(parents=True)
    # comm may hold spaces and parentheses: the fields after the last ')' count
    fields = ["S"] + ["0"] * 18 + [str(start)] + ["0"] * 10
    (proc / str(pid) / "stat").write_text(f"{pid} (evil) 1 2) " + " ".join(fields) + "\n")
    if namespace_of is None:
        (proc / str(pid) / "ns" / "pid").write_text("")
    else:
        os.link(namespace_of / "ns" / "pid", proc / str(pid) / "ns" / "pid")
    return os.stat(proc / str(pid) / "ns" / "pid").st_ino


def test_uprobes_new_group_names_this_process_and_parses_back() -> None:
    group = uprobes.new_group()
    assert len(group) <= 64 and group.startswith(uprobes.GROUP_PREFIX)
    assert uprobes.new_group() != group  # a serial apart: two sources in one process
    assert uprobes.dead_groups({group}) == set()  # we run


def test_only_provably_dead_agents_groups_go(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    mine = _process(proc, 100, 5000)
    os.symlink("100", proc / "self")
    _process(proc, 200, 7000, namespace_of=proc / "100")  # a live agent beside us
    other_ns = _process(proc, 300, 9000)  # a process in another PID namespace, alive
    live = uprobes.group_name(mine, 200, 7000)
    reused = uprobes.group_name(mine, 200, 6999)  # pid 200 now holds a later process
    gone = uprobes.group_name(mine, 250, 7000)  # no such pid
    ours = uprobes.group_name(mine, 100, 5000, 3)
    in_live_ns = uprobes.group_name(other_ns, 7, 10)
    in_dead_ns = uprobes.group_name(other_ns + 999, 7, 10)
    foreign = {"profagent_0000000000bb", "profagent_12ab", "profagent_x_1_2_3", "profagent_1_2_3_4_5"}
    groups = {live, reused, gone, ours, in_live_ns, in_dead_ns, *foreign}
    # we are not in the initial namespace: another namespace's agents cannot be checked
    assert uprobes.dead_groups(groups, proc) == {reused, gone}
    # from the initial namespace every process is visible: a namespace nobody is in is gone
    assert uprobes.dead_groups(groups, proc, initial=mine) == {reused, gone, in_dead_ns}


def test_nothing_is_removed_when_proc_cannot_be_read(tmp_path: Path) -> None:
    group = uprobes.group_name(1, 2, 3)
    assert uprobes.dead_groups({group}, tmp_path / "missing") == set()

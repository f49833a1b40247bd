"""`profagent doctor` rows for on-demand tracing: who holds the Kineto endpoint, who polls."""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Iterator

from profagent.config import Config
from profagent.doctor.check import OK, WARN, Check
from profagent.errors import SourceUnavailable
from profagent.sources.ondemand import kineto
from profagent.sources.ondemand.endpoint import Endpoint, EndpointHeld
from profagent.system.unixsock import call, default_control_socket


def check_trace_dir(trace_dir: str) -> Check | None:
    """A row when the on-demand trace folder exists but the agent will refuse it (a user
    made it first: a symlink, a file, or a folder of theirs), with what to do; else None."""
    try:
        st = os.lstat(trace_dir)
    except OSError:
        return None  # absent: the agent creates it
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
        return None
    what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode) else "a file"
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    return Check("ondemand", "on-demand trace folder", WARN,
                 f"{trace_dir} is {what} of user {owner}, made before the agent: the agent refuses it, so "
                 "on-demand tracing is off",
                 f"see what {owner} put there, remove it (rm -r {trace_dir}) and restart the agent; or set "
                 "ondemand.trace_dir to a folder under one only root can write (e.g. /var/lib/profagent/ondemand)")


def check_ondemand(config: Config) -> Iterator[Check]:
    """Is the Kineto endpoint free, held by a profagent agent (and who polls it), or by another daemon?"""
    if row := check_trace_dir(config.ondemand.trace_dir):
        yield row
    if problem := kineto.socket_dir_problem(config.ondemand.socket_dir):
        yield Check("ondemand", "Kineto socket folder", WARN, problem, kineto.SOCKET_DIR_FIX)
    endpoint = Endpoint(config.ondemand.socket_dir)
    where = endpoint.describe()
    try:
        endpoint.bind()
    except SourceUnavailable:
        pass
    except EndpointHeld as exc:  # held by a user other than root: a root agent serves no job there
        yield Check("ondemand", "Kineto endpoint", WARN, exc.problem, exc.fix)
        return
    else:
        endpoint.close()
        yield Check("ondemand", "Kineto endpoint", OK, f"{where} is free: an agent started now will host it")
        return
    control = config.ondemand.control_socket or default_control_socket()
    try:
        reply = call(control, {"op": "registry"}, timeout=2)
    except (OSError, ValueError):
        yield Check("ondemand", "Kineto endpoint", WARN, f"{where} is held by another daemon (dynolog?)",
                    "stop it, or trace through that daemon; profagent's on-demand source stays off")
        return
    if reply.get("error") == "ondemand_off":  # our agent runs, with its on-demand source off
        yield Check("ondemand", "Kineto endpoint", WARN,
                    f"{where} is held by another daemon (dynolog?); the profagent agent at {control} has on-demand "
                    f"tracing off ({reply.get('reason') or 'see its log'})",
                    "stop that daemon and restart the agent, or trace through that daemon")
        return
    pollers = reply.get("pollers", [])
    yield Check("ondemand", "Kineto endpoint", OK, f"{where} is hosted by a running profagent agent ({control})")
    if pollers:
        names = ", ".join(f"{p['pid']}" + (f" (rank {p['rank']})" if p.get("rank") else "") for p in pollers[:8])
        yield Check("ondemand", "polling processes", OK, f"{len(pollers)}: {names}")
    else:
        yield Check("ondemand", "polling processes", WARN, "none",
                    "start training scripts with KINETO_USE_DAEMON=1 to trace them with `profagent trace`")

"""`profagent doctor` rows for on-demand tracing: who holds the Kineto endpoint, who polls."""

from __future__ import annotations

from collections.abc import Iterator

from profagent.config import Config
from profagent.doctor.check import OK, WARN, Check
from profagent.errors import SourceUnavailable
from profagent.sources.ondemand import kineto
from profagent.sources.ondemand.endpoint import Endpoint
from profagent.system.unixsock import call, default_control_socket


def check_ondemand(config: Config) -> Iterator[Check]:
    """Is the Kineto endpoint free, held by a profagent agent (and who polls it), or by another daemon?"""
    if problem := kineto.socket_dir_problem(config.ondemand.socket_dir):
        yield Check("ondemand", "Kineto socket folder", WARN, problem, kineto.SOCKET_DIR_FIX)
    endpoint = Endpoint(config.ondemand.socket_dir)
    where = endpoint.describe()
    try:
        endpoint.bind()
    except SourceUnavailable:
        pass
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

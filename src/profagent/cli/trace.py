"""`profagent trace`: ask the running agent for an on-demand trace, wait, print the report."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from profagent.errors import UserError
from profagent.labels import printable
from profagent.system.safefs import UnsafePath, open_regular
from profagent.system.unixsock import call

HOW_TO_POLL = (
    "start the training script with KINETO_USE_DAEMON=1 in its environment "
    "(no code change; it polls the agent every ~5 s), then run profagent trace again"
)


@dataclass(frozen=True)
class TraceRequestArgs:
    pid: int | None = None
    job: str | None = None
    all: bool = False
    duration_ms: int = 500
    iterations: int = 0
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    timeout: float = 60.0


def _ask(control_socket: str, request: dict[str, Any]) -> dict[str, Any]:
    try:
        return call(control_socket, request)
    except FileNotFoundError:
        raise UserError(
            f"no profagent agent is running here (no control socket at {control_socket})",
            "start `profagent attach --pid N` (or the profagent service) first; if one runs, its on-demand "
            "source is off (its log and `profagent doctor` say why) or it has another ondemand.control_socket",
        ) from None
    except (ConnectionRefusedError, OSError) as exc:
        raise UserError(f"cannot talk to the agent at {control_socket} ({exc})", "check that it runs and that you are its user (or root)") from None


def _complete_json(path: Path) -> bool:
    """libkineto writes the file in place: it is complete once it parses."""
    import orjson

    try:  # a FIFO or symlink planted where the trace goes must not hang or fool us
        with os.fdopen(open_regular(str(path)), "rb") as fh:
            data = fh.read()
        return bool(data) and isinstance(orjson.loads(data), dict)
    except (OSError, UnsafePath, orjson.JSONDecodeError):
        return False


def request_trace(
    control_socket: str,
    args: TraceRequestArgs,
    console: Console,
    report: Callable[[dict[Path, str | None]], None],  # every trace file -> its rank when known, at once
    clock: Callable[[], float] = time.monotonic,
) -> list[Path]:
    """Request, follow and report. Returns the trace files. Raises UserError on failure."""
    if sum([args.pid is not None, args.job is not None, args.all]) != 1:
        raise UserError("choose what to trace", "give exactly one of --pid N, --job J or --all")
    req: dict[str, Any] = {
        "op": "trace", "duration_ms": args.duration_ms, "iterations": args.iterations,
        "record_shapes": args.record_shapes, "profile_memory": args.profile_memory,
        "with_stack": args.with_stack, "timeout": args.timeout,
    }
    if args.pid is not None:
        req["pid"] = args.pid
    elif args.job is not None:
        req["job"] = args.job
    reply = _ask(control_socket, req)
    if not reply.get("ok"):
        if reply.get("error") == "ondemand_off":
            raise UserError(f"on-demand tracing is off in the profagent agent PID {reply.get('agent_pid')} "
                            f"({reply.get('reason') or 'see its log'})",
                            "fix that and restart the agent; `profagent doctor` checks the Kineto endpoint")
        if reply.get("error") == "no_pollers":
            polling = ", ".join(str(p["pid"]) for p in reply.get("pollers", [])) or "none"
            raise UserError(f"no process matching the request polls the agent (processes polling: {polling})", HOW_TO_POLL)
        if reply.get("error") == "job_not_watched":
            polling = ", ".join(str(p["pid"]) for p in reply.get("pollers", [])) or "none"
            raise UserError(
                f"the Kineto endpoint is held by the profagent agent PID {reply.get('agent_pid')}, which watches "
                f"job {', '.join(reply.get('agent_jobs') or ['?'])}, not job {args.job}: it cannot tell that job's ranks apart",
                f"trace them through it with --pid LAUNCHER_OR_RANK_PID (processes polling: {polling})",
            )
        raise UserError(f"the agent refused the request ({reply.get('error')})", "check the options")

    rid, targets = reply["id"], reply["targets"]
    # a rank is the job's word (its environment): control characters escaped, never markup
    names = {t["pid"]: f"PID {t['pid']}" + (f" (rank {printable(str(t['rank']))})" if t.get("rank") else "")
             for t in targets}
    console.print(f"trace {rid}: {len(targets)} process(es): {', '.join(names.values())}", markup=False, highlight=False,
                  soft_wrap=True)
    window = (f"{args.iterations} iteration(s)" if args.iterations else f"{args.duration_ms} ms")
    deadline = clock() + args.timeout
    done: dict[int, Path] = {}
    stage: dict[int, str] = {}
    # polled free, with no trace, after an iteration config was sent: libkineto dropped it,
    # as it does before the process's first step (sources/ondemand/endpoint.py)
    waiting_for_step: set[int] = set()
    with console.status("waiting for the next poll (up to ~5 s)") as status:
        while len(done) < len(targets):
            if clock() > deadline:
                missing = ", ".join(names[p] for p in names if p not in done)
                unstepped = [names[p] for p in names if p not in done and p in waiting_for_step]
                if unstepped:
                    raise UserError(f"no trace from {missing} within {args.timeout:.0f} s: {', '.join(unstepped)} "
                                    "had run no optimizer step when last asked (libkineto counts iterations from them)",
                                    "retry once it trains, with a longer --timeout, or use --duration-ms")
                raise UserError(
                    f"no trace from {missing} within {args.timeout:.0f} s",
                    "the process may be idle between iterations, not calling the profiler hooks, or profiling "
                    "itself with torch.profiler (libkineto runs one profiler at a time); "
                    "retry with a longer --timeout, or --duration-ms instead of --iterations",
                )
            state = _ask(control_socket, {"op": "status", "id": rid})
            for t in state.get("targets", []):
                pid, path = t["pid"], Path(t["file"])
                if pid in done:
                    continue
                waiting_for_step.discard(pid)
                if not t["sent"]:
                    new = "waiting for the next poll"
                elif not path.exists() and args.iterations and t.get("resent"):
                    new = f"waiting for an optimizer step (libkineto counts iterations from them; asked {1 + t['resent']} times)"
                    waiting_for_step.add(pid)
                elif not path.exists():
                    new = f"tracing {window} (after libkineto's warm-up)"
                elif not _complete_json(path):
                    new = "writing"
                else:
                    new = "ingesting"
                    done[pid] = path
                if stage.get(pid) != new:
                    stage[pid] = new
                    console.print(f"  {names[pid]}: {new}", markup=False, highlight=False, soft_wrap=True)
                    status.update(escape(f"{names[pid]}: {new}"))
            time.sleep(0.2)
    rank_of = {t["pid"]: (str(t["rank"]) if t.get("rank") else None) for t in targets}
    for pid, path in done.items():
        console.print(f"[bold]{escape(names[pid])}[/bold]: {escape(printable(str(path)))}", highlight=False, soft_wrap=True)
    # One report of the whole request (one JSON document with --json): every rank, then
    # the cross-rank summary.
    report({path: rank_of[pid] for pid, path in done.items()})
    return list(done.values())

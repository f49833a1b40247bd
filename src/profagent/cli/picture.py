"""`profagent timeline`: a picture of every rank's recent steps (Chrome's trace event
format: Perfetto UI and chrome://tracing open it), from one running agent (``--url``), from
every node's agent of a job found through Prometheus (``--prometheus --job``), or from an
in-process agent attached to ``--pid`` for ``--seconds``. Each node's steps come on its own
probe clock with its offset to Unix time, so the merged picture has one clock.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rich.console import Console

from profagent.analysis.timeline_picture import BadHistory, chrome_trace, history_from_json
from profagent.cli.client import NO_AUTH, ClientAuth, JsonClient
from profagent.cli.prometheus import fetch_series
from profagent.config import Config
from profagent.contracts import TimelineHistory
from profagent.errors import UserError

MAX_AGENTS = 512  # nodes of one job asked
PLACE_SECONDS = 60.0  # --pid: for the probes to be placed (the library's symbols are read first)
OPEN_HOW = "open it at https://ui.perfetto.dev (Open trace file) or in chrome://tracing"


def from_agent(url: str, seconds: float, ranks: list[str], job: str | None, auth: ClientAuth = NO_AUTH) -> TimelineHistory:
    """The history of one agent's ranks (GET /api/timeline?format=history)."""
    client = JsonClient(url, auth, timeout=30.0)
    query: dict[str, Any] = {"seconds": str(seconds), "format": "history", "rank": ranks}
    if job:
        query["job"] = job
    body = client.get_json("/api/timeline", query, not_found=(
        f"{client.shown} has no /api/timeline", "upgrade the agent (profagent 0.9 or later), or check --url"))
    try:
        return history_from_json(body)
    except BadHistory as exc:
        raise UserError(f"{client.url('/api/timeline')} did not answer a timeline history ({exc})",
                        "check that --url points at a profagent agent") from None


def from_agents(agents: list[str], seconds: float, ranks: list[str], job: str | None,
                auth: ClientAuth = NO_AUTH) -> list[TimelineHistory]:
    """Each agent's history; agents that name their node alike (containers, one host in
    a test) are told apart by their address, so each gets its own process in the picture."""
    histories = [from_agent(agent, seconds, ranks, job, auth) for agent in agents]
    names = [h.node for h in histories]
    out = []
    for agent, h in zip(agents, histories, strict=True):
        if names.count(h.node) > 1:
            node = f"{h.node} ({urlsplit(agent).netloc})"
            h = dataclasses.replace(h, node=node, ranks=tuple(dataclasses.replace(r, node=node) for r in h.ranks))
        out.append(h)
    return out


def agents_of_job(prometheus: str, job: str, auth: ClientAuth = NO_AUTH) -> list[str]:
    """The URL of each agent that exports steps of ``job``, from the targets Prometheus
    scrapes: the instances with the job's step counters, at their scrape URL's scheme and
    path (an https agent, an agent behind a path prefix)."""
    fix = "check --prometheus: the Prometheus (or Thanos, Mimir) URL, e.g. http://prometheus:9090"
    series = fetch_series(prometheus, f"profagent_optimizer_steps_total{{job_id={json.dumps(job, ensure_ascii=False)}}}",
                          auth)
    instances = sorted({s["instance"] for s in series if s.get("instance")})
    if not instances:
        raise UserError(f"Prometheus at {prometheus} has no steps of job {job!r} from any agent",
                        "check --job (profagent_optimizer_steps_total's job_id) and that the agents' timeline is on")
    client = JsonClient(prometheus, auth, what="Prometheus", reach_fix=fix)
    body = client.get_json("/api/v1/targets", {"state": "active"})
    active = body.get("data", {}).get("activeTargets") if isinstance(body, dict) and isinstance(body.get("data"), dict) else None
    scraped: dict[str, str] = {}
    for target in active if isinstance(active, list) else ():
        labels = target.get("labels") if isinstance(target, dict) else None
        url = target.get("scrapeUrl") if isinstance(target, dict) else None
        if isinstance(labels, dict) and isinstance(url, str) and isinstance(labels.get("instance"), str):
            scraped.setdefault(labels["instance"], url)
    agents = []
    for instance in instances[:MAX_AGENTS]:
        url = scraped.get(instance)
        if url is None:
            url = f"http://{instance}"  # scraped once, no longer a target: its address
        else:
            parts = urlsplit(url)
            url = f"{parts.scheme}://{parts.netloc}{parts.path.removesuffix('/metrics')}"
        agents.append(url)
    return agents


def from_pid(config: Config, pid: int, seconds: float, console: Console) -> TimelineHistory:
    """Attach an in-process agent (no HTTP server, no on-demand endpoint) for ``seconds``
    and take its timeline's steps."""
    import socket

    from profagent.engine.agent import Job
    from profagent.sources.timeline.source import TimelineSource, capability_problem
    from profagent.target import check_attachable

    check_attachable(pid)
    if not config.timeline.enabled:
        raise UserError("the timeline is off (timeline.enabled = false)", "remove it from the config for timeline")
    config.ondemand.enabled = False  # an agent already running may hold the endpoint
    # the probes alone: no py-spy pausing the ranks, no bundle, no findings
    config.incidents.enabled = config.stacks.enabled = config.findings.enabled = False
    config.traces.dirs = []
    job = Job(config, pid)
    source = next(s for s in job.sources if isinstance(s, TimelineSource))
    job.start()
    stop = threading.Event()
    try:
        if not source.running:
            why = capability_problem() or "the timeline source did not start (run with --log-level info)"
            raise UserError(f"the kernel probes cannot run here: {why}",
                            "run it as root (see docs/timeline.md, Permissions), or ask a running agent with --url")
        deadline = time.monotonic() + PLACE_SECONDS
        while not source.probing and not stop.wait(0.2) and time.monotonic() < deadline:
            if job.runtime.target_gone_for() > 0:
                raise UserError(f"PID {pid} ended before its libtorch was probed", "give the PID of a running job")
        if not source.probing:
            raise UserError(f"no libtorch probed in PID {pid}'s ranks within {PLACE_SECONDS:.0f} s",
                            "give the PID of a torch job (its launcher or a rank), see docs/timeline.md")
        console.print(f"observing PID {pid} for {seconds:.0f} s...", highlight=False)
        deadline = time.monotonic() + seconds
        while not stop.wait(0.5) and time.monotonic() < deadline:
            if job.runtime.target_gone_for() > 0:
                break
        return source.history(seconds, socket.gethostname())
    finally:
        job.stop()


def write_picture(histories: list[TimelineHistory], seconds: float, output: Path) -> str:
    """Write the picture of ``histories`` to ``output``; the line saying what was written."""
    doc = chrome_trace(histories, seconds)
    try:
        output.write_text(json.dumps(doc, separators=(",", ":")))
    except OSError as exc:
        raise UserError(f"cannot write {output} ({exc.strerror or exc})", "give -o a writable file") from None
    ranks = [r for h in histories for r in h.ranks]
    steps = sum(len(r.steps) for r in ranks)
    nodes = len({h.node for h in histories})
    return (f"wrote {output}: {len(ranks)} rank{'s' * (len(ranks) != 1)} on {nodes} node{'s' * (nodes != 1)}, "
            f"{steps} steps; {OPEN_HOW}")

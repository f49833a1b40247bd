"""`profagent diagnose`: what is wrong with a job now, ranked by severity, with evidence.

From a running agent (``--url``, or the local one for ``--job``), or from a short-lived
in-process agent attached to ``--pid``.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any
from urllib.parse import urlencode, urlunsplit

from rich.console import Console
from rich.markup import escape

from profagent.cli.client import NO_AUTH, ClientAuth, JsonClient, parse_agent_url
from profagent.config import DEFAULT_PORT, Config
from profagent.errors import UserError
from profagent.labels import printable_data

LOCAL_AGENT = f"http://127.0.0.1:{DEFAULT_PORT}"
COLORS = {"critical": "bold red", "warning": "yellow", "info": "cyan"}
RANKED = {"critical": 0, "warning": 1, "info": 2}


def findings_url(url: str, job: str | None) -> str:
    """The /api/findings URL of an agent given as its root or its /metrics URL."""
    parts = parse_agent_url(url)
    path = parts.path.rstrip("/")
    path = path[: -len("/metrics")] if path.endswith("/metrics") else path
    return urlunsplit((parts.scheme, parts.netloc, path + "/api/findings", urlencode({"job": job}) if job else "", ""))


def fetch(url: str, job: str | None = None, auth: ClientAuth = NO_AUTH, timeout: float = 10.0) -> dict[str, Any]:
    """GET /api/findings. Raises UserError for an unreachable agent, a refused login or bad JSON."""
    client = JsonClient(url, auth, timeout=timeout)
    body = client.get_json("/api/findings", {"job": job} if job else None,
                           not_found=(f"{client.shown} has no findings endpoint", "upgrade the agent, or check the URL"))
    if not isinstance(body, dict) or not isinstance(body.get("findings"), list):
        raise UserError(f"{findings_url(url, job)} did not answer a findings list", "check that --url points at a profagent agent")
    return body


def collect_local(config: Config, pid: int, seconds: float, console: Console) -> dict[str, Any]:
    """Attach an in-process agent (no HTTP server, no on-demand endpoint) for ``seconds``."""
    from profagent.engine.agent import Job
    from profagent.target import check_attachable

    check_attachable(pid)
    config.ondemand.enabled = False  # an agent already running may hold the endpoint
    job = Job(config, pid)
    if job.findings is None:
        raise UserError("findings are off (findings.enabled = false)", "remove it from the config for diagnose")
    job.start()
    stop = threading.Event()
    try:
        console.print(f"observing PID {pid} for {seconds:.0f} s...", highlight=False)
        deadline = time.monotonic() + seconds
        while not stop.wait(0.5) and time.monotonic() < deadline:
            if job.runtime.target_gone_for() > 0:
                break
        snapshot = job.findings.tick()
    finally:
        job.stop()
    return {"findings": [f.as_dict() for f in snapshot.findings], "time": snapshot.time}


def _evidence_lines(evidence: dict[str, Any]) -> list[str]:
    lines = []
    for key, value in evidence.items():
        if key == "stacks" and isinstance(value, dict):
            for rank, frames in sorted(value.items()):
                lines.append(f"stack of rank {rank} (innermost last):")
                lines += [f"    {frame}" for frame in frames]
        elif key == "roles" and isinstance(value, dict):  # hang: what each rank does
            for rank, role in sorted(value.items()):
                if isinstance(role, dict):
                    where = role.get("collective") or role.get("at")
                    inner = role.get("innermost")
                    beside = f" (in {inner})" if inner and inner != where and not role.get("collective") else ""
                    lines.append(f"rank {rank}: {role.get('role')}{' (stalled)' if role.get('stalled') else ''}: {where}{beside}")
        elif key == "dataloader_workers" and isinstance(value, dict):  # hang: a rank's workers
            for rank, workers in sorted(value.items()):
                for w in workers if isinstance(workers, list) else ():
                    if isinstance(w, dict):
                        state = "stands still" if w.get("stuck") else "moves"
                        lines.append(f"rank {rank}: DataLoader worker PID {w.get('pid')} {state} at {w.get('at')}")
        elif isinstance(value, (dict, list)):
            lines.append(f"{key}: {json.dumps(value)}")
        else:
            lines.append(f"{key}: {value}")
    return lines


def _render_steps(steps: list[dict[str, Any]], console: Console) -> None:
    """Each rank's step time and where it goes, from the kernel probes (no trace needed),
    and, where its steps do not begin at Optimizer.step, where they begin and why."""
    shown = [s for s in steps if isinstance(s, dict) and (s.get("p50_seconds") is not None or s.get("steps_note"))]
    if not shown:
        return
    console.print("[bold]steps[/bold] (kernel probes, docs/timeline.md):", highlight=False)
    for s in shown:
        who = f"  job {escape(str(s.get('job_id')))} rank {escape(str(s.get('rank')))}: "
        note = s.get("steps_note")
        if s.get("p50_seconds") is None:
            console.print(who + escape(str(note)), highlight=False, soft_wrap=True)
            continue
        shares = s.get("stage_shares") or {}
        stages = ", ".join(f"{escape(str(k))} {v:.0%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])
                           if isinstance(v, (int, float)))
        rate = s.get("steps_per_second")
        console.print(who + f"p50 {s['p50_seconds'] * 1e3:.1f} ms, p90 {(s.get('p90_seconds') or 0) * 1e3:.1f} ms"
                      + (f", {rate:.1f} steps/s" if isinstance(rate, (int, float)) else "")
                      + (f"; {stages}" if stages else "")
                      + (f"; step boundary: {escape(str(s.get('step_boundary')))}" if note else ""),
                      highlight=False, soft_wrap=True)
        if note:
            console.print(f"    {escape(str(note))}", highlight=False, soft_wrap=True, style="dim")


def render(body: dict[str, Any], console: Console, now: float | None = None) -> None:
    """The human report: most severe first, each with its evidence (control characters
    escaped and markup escaped in every string: they come from the watched jobs)."""
    body = printable_data(body)
    findings = sorted(body["findings"], key=lambda f: (RANKED.get(f.get("severity"), 3), f.get("finding", ""), f.get("rank") or ""))
    _render_steps(body.get("steps") or [], console)
    if not findings:
        console.print("[green]no findings[/green]: nothing wrong that profagent can see right now (docs/diagnosis.md says what it can see)")
        return
    now = now if now is not None else body.get("time") or time.time()
    for f in findings:
        who = f"rank {escape(str(f['rank']))}" if f.get("rank") is not None else "job"
        since = max(0.0, now - f.get("since", now))
        color = COLORS.get(f.get("severity"), "")
        console.print(f"[{color}]{escape(str(f['severity']).upper())}[/{color}] [bold]{escape(f['finding'])}[/bold] "
                      f"(job {escape(f['job_id'])}, {who}, for {since:.0f} s)", highlight=False)
        console.print(f"  {escape(f['summary'])}", highlight=False, soft_wrap=True)
        if f.get("advice"):
            console.print(f"  [bold]what to do[/bold]: {escape(str(f['advice']))}", highlight=False, soft_wrap=True)
        for line in _evidence_lines(f.get("evidence") or {}):
            console.print(f"    {escape(line)}", highlight=False, soft_wrap=True, style="dim")

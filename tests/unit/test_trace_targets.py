"""`profagent trace --pid LAUNCHER` / `--job` trace the ranks, never torchrun itself.

The control server's "trace" op, driven with real Kineto poll datagrams on a real
endpoint (no socket needed: the pollers register through ``Endpoint.handle``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from rich.console import Console

from profagent.cli.trace import TraceRequestArgs, request_trace
from profagent.contracts import ProcessInfo, ProcessTree
from profagent.engine.control import ControlServer
from profagent.errors import UserError
from profagent.sources.ondemand import kineto
from profagent.sources.ondemand.source import OndemandSource

LAUNCHER, RANK0, RANK1, WORKER, STRANGER = 100, 101, 102, 103, 200


def _source(tmp_path: Path) -> OndemandSource:
    src = OndemandSource(interval=1, trace_dir=str(tmp_path), periodic_minutes=0, keep=2, clock=lambda: 0.0)
    tree = ProcessTree("j", LAUNCHER, (
        ProcessInfo(LAUNCHER, 1, 0.0, "launcher", "", "", "2", "torchrun", "j"),
        ProcessInfo(RANK0, LAUNCHER, 0.0, "main", "0", "0", "2", "python train.py", "j"),
        ProcessInfo(RANK1, LAUNCHER, 0.0, "main", "1", "1", "2", "python train.py", "j"),
        ProcessInfo(WORKER, RANK0, 0.0, "dataloader", "0", "0", "2", "python train.py", "j"),
    ), True)
    # Every one of them polls (KINETO_USE_DAEMON=1 is inherited by the launcher's children).
    for pid, ancestors in ((LAUNCHER, (1,)), (RANK0, (LAUNCHER, 1)), (RANK1, (LAUNCHER, 1)),
                           (WORKER, (RANK0, LAUNCHER, 1)), (STRANGER, (1,))):
        src.endpoint.handle(kineto.encode_poll(kineto.Poll(3, 0, (pid, *ancestors))))
    src.collect(tree)
    return src


def _targets(tmp_path: Path, **req: object) -> set[int]:
    reply = ControlServer(str(tmp_path / "ctl.sock"), _source(tmp_path)).handle({"op": "trace", **req})
    assert reply["ok"], reply
    return {t["pid"] for t in reply["targets"]}


def test_pid_of_the_launcher_traces_its_ranks_only(tmp_path: Path) -> None:
    assert _targets(tmp_path, pid=LAUNCHER) == {RANK0, RANK1}


def test_pid_of_a_rank_traces_that_rank(tmp_path: Path) -> None:
    assert _targets(tmp_path, pid=RANK1) == {RANK1}


def test_job_traces_its_ranks_only(tmp_path: Path) -> None:
    assert _targets(tmp_path, job="j") == {RANK0, RANK1}


def test_all_still_traces_every_poller(tmp_path: Path) -> None:
    assert _targets(tmp_path, all=True) == {LAUNCHER, RANK0, RANK1, WORKER, STRANGER}


def test_job_of_another_agent_names_the_agent_holding_the_endpoint(tmp_path: Path) -> None:
    """Several agents on one node: the one holding the Kineto endpoint watches job "j"; a
    `trace --job other` gets one line naming that agent, not "start with KINETO_USE_DAEMON=1"."""
    server = ControlServer(str(tmp_path / "ctl" / "control.sock"), _source(tmp_path))
    server.bind()
    stop = threading.Event()
    serving = threading.Thread(target=server.serve, args=(stop,))
    serving.start()
    try:
        with pytest.raises(UserError) as caught:
            request_trace(server.path, TraceRequestArgs(job="other"), Console(stderr=True),
                          report=lambda ranks: None)
    finally:
        stop.set()
        serving.join()
        server.close()
    message = str(caught.value)
    assert f"held by the profagent agent PID {os.getpid()}, which watches job j, not job other" in message
    assert "--pid" in message and "KINETO_USE_DAEMON" not in message
    assert "\n" not in message

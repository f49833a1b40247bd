"""On-demand traces through Kineto's daemon protocol, with real torch processes."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.agent import free_port, http_get, parse_metrics
from helpers.paths import ROOT
from helpers.processes import kill_tree, wait_for
from profagent.doctor.check import Check
from profagent.sources.ondemand import kineto
from profagent.sources.ondemand.endpoint import (
    MAX_RESENDS,
    RESEND_AFTER,
    TIMED_START,
    Endpoint,
    NoPollers,
    match_pid,
)

TRAIN = str(ROOT / "examples" / "train.py")


# -- protocol (pure) -----------------------------------------------------------------
def test_poll_round_trip_and_config_text() -> None:
    poll = kineto.Poll(3, 42, (100, 50, 1))
    assert kineto.decode(kineto.encode_poll(poll)) == poll
    assert len(kineto.encode_poll(poll)) == 40 + 16 + 12
    text = kineto.config_text("/tmp/x/a.json", kineto.TraceOptions(iterations=3, profile_memory=True), "id1")
    assert "ACTIVITIES_ITERATIONS=3" in text and "PROFILE_START_ITERATION_ROUNDUP=1" in text
    assert "ACTIVITIES_DURATION_MSECS=0" in text and "PROFILE_PROFILE_MEMORY=true" in text  # no timed fallback
    assert text.splitlines()[0] == "ACTIVITIES_LOG_FILE=/tmp/x/a.json" and not text.endswith("\0")
    assert kineto.output_path("/tmp/x/a.json", 7) == "/tmp/x/a_7.json"


@pytest.mark.parametrize(
    "datagram",
    [b"", b"x" * 39, struct.pack("<Q32s", 5, b"req") + b"abc", struct.pack("<Q32s", 0, b"bogus"),
     struct.pack("<Q32s", 16, b"req") + struct.pack("<iiq", 3, 0, 0),
     struct.pack("<Q32s", 20, b"req") + struct.pack("<iiqi", 3, 9, 0, 1)],
)
def test_malformed_datagrams_are_rejected(datagram: bytes) -> None:
    with pytest.raises(kineto.MalformedDatagram):
        kineto.decode(datagram)
    endpoint = Endpoint()
    assert endpoint.handle(datagram) is None
    assert endpoint.counts()["malformed"] == 1


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fuzzed_datagrams_never_raise(data: bytes) -> None:
    endpoint = Endpoint()
    reply = endpoint.handle(data)
    assert reply is None or reply[:8] == struct.pack("<Q", len(reply) - 40)


def test_request_goes_to_the_matching_pollers_once() -> None:
    now = [0.0]
    endpoint = Endpoint(clock=lambda: now[0])
    for pid, parent in ((11, 10), (12, 10), (21, 20)):
        endpoint.handle(kineto.encode_poll(kineto.Poll(3, 0, (pid, parent, 1))))
    with pytest.raises(NoPollers):
        endpoint.request(match_pid(99), kineto.TraceOptions(), "/tmp/d", timeout=30)
    request = endpoint.request(match_pid(10), kineto.TraceOptions(), "/tmp/d", timeout=30)
    assert sorted(request.targets) == [11, 12]  # the launcher PID matches both ranks
    config = endpoint.handle(kineto.encode_poll(kineto.Poll(3, 0, (11, 10, 1))))[40:].decode()
    assert f"ACTIVITIES_LOG_FILE={request.log_file}" in config
    busy = endpoint.handle(kineto.encode_poll(kineto.Poll(1, 0, (12, 10, 1))))
    assert busy[40:] == b""  # a process already tracing gets nothing
    again = endpoint.handle(kineto.encode_poll(kineto.Poll(3, 0, (11, 10, 1))))
    assert again[40:] == b""  # one config per request
    assert endpoint.handle(kineto.encode_poll(kineto.Poll(3, 0, (21, 20, 1))))[40:] == b""
    now[0] = 61.0
    assert endpoint.pollers() == []  # silent for a minute: gone


def test_a_config_libkineto_dropped_is_sent_again_and_a_written_one_is_not(tmp_path: Path) -> None:
    """libkineto drops a timed config it could not start within ~2 s, and then polls free to
    trace: that poll, 3 s or more after the send and with no trace file, gets it again."""
    now = [0.0]
    endpoint = Endpoint(clock=lambda: now[0])

    def poll(pid: int, can_trace: bool = True) -> str:
        return endpoint.handle(kineto.encode_poll(kineto.Poll(3 if can_trace else 1, 0, (pid, 1))))[40:].decode()

    poll(11), poll(12)
    request = endpoint.request(match_pid(1), kineto.TraceOptions(), str(tmp_path), timeout=30)
    assert "ACTIVITIES_LOG_FILE" in poll(11) and "ACTIVITIES_LOG_FILE" in poll(12)
    now[0] = 2.9
    assert poll(11) == ""  # too soon: libkineto may not have started it yet
    now[0] = 5.0
    assert poll(12, can_trace=False) == ""  # warming up: busy
    Path(request.targets[12].file).write_text("{}")  # rank 12 wrote its trace
    assert poll(12) == ""
    assert f"REQUEST_TRACE_ID={request.id}" in poll(11)  # dropped: sent again
    assert endpoint.counts()["resent"] == 1 and request.targets[11].resent == 1
    for k in range(2, 4):  # at most MAX_RESENDS times, each after RESEND_AFTER
        now[0] += 5.0
        assert "ACTIVITIES_LOG_FILE" in poll(11)
        assert request.targets[11].resent == k
    now[0] += 5.0
    assert poll(11) == ""
    assert endpoint.counts() | {"poll": 0} == {"poll": 0, "requested": 1, "sent": 2, "resent": 3}
    late = endpoint.request(match_pid(1), kineto.TraceOptions(), str(tmp_path), timeout=30)
    assert "ACTIVITIES_LOG_FILE" in poll(11)
    now[0] += 30.0
    assert poll(11) == "" and late.targets[11].resent == 0  # past its timeout: never again


def test_a_timed_config_is_not_sent_again_once_its_trace_would_have_ended(tmp_path: Path) -> None:
    """A free poll with no file after a timed trace would have ended (TIMED_START plus its
    duration after the send) may come while libkineto writes it: sent again, it would make
    a second trace."""
    now = [0.0]
    endpoint = Endpoint(clock=lambda: now[0])

    def poll(pid: int) -> str:
        return endpoint.handle(kineto.encode_poll(kineto.Poll(3, 0, (pid, 1))))[40:].decode()

    poll(11)
    timed = endpoint.request(match_pid(1), kineto.TraceOptions(duration_ms=1000), str(tmp_path), timeout=60)
    assert "ACTIVITIES_LOG_FILE" in poll(11)
    now[0] = TIMED_START + 1.0  # its trace would have ended now
    assert poll(11) == "" and timed.targets[11].resent == 0


def test_an_iteration_config_is_sent_again_until_the_process_steps_then_never(tmp_path: Path) -> None:
    """libkineto drops an iteration config that comes before the process's first step (and
    would run a 500 ms timed trace instead, were the duration not 0): while the process
    polls free with no file, it gets it again every RESEND_AFTER, with no cap, until the
    request's deadline; once its trace is written, never."""
    now = [0.0]
    endpoint = Endpoint(clock=lambda: now[0])

    def poll(pid: int, can_trace: bool = True) -> str:
        return endpoint.handle(kineto.encode_poll(kineto.Poll(3 if can_trace else 1, 0, (pid, 1))))[40:].decode()

    poll(11)
    request = endpoint.request(match_pid(1), kineto.TraceOptions(iterations=3), str(tmp_path), timeout=60)
    config = poll(11)
    assert "ACTIVITIES_ITERATIONS=3" in config and "ACTIVITIES_DURATION_MSECS=0" in config
    now[0] = RESEND_AFTER - 0.1
    assert poll(11) == ""  # too soon
    sends = 0
    for t in range(1, 7):  # more than MAX_RESENDS: the process has not stepped yet
        now[0] = t * RESEND_AFTER
        sends += "ACTIVITIES_ITERATIONS=3" in poll(11)
    assert sends == 6 > MAX_RESENDS and request.targets[11].resent == 6
    now[0] += RESEND_AFTER
    assert poll(11, can_trace=False) == ""  # it steps: tracing, busy
    Path(request.targets[11].file).write_text("{}")
    now[0] += RESEND_AFTER
    assert poll(11) == "" and request.targets[11].resent == 6  # written: never again
    late = endpoint.request(match_pid(1), kineto.TraceOptions(iterations=3), str(tmp_path), timeout=10)
    assert "ACTIVITIES_ITERATIONS=3" in poll(11)
    now[0] += 10.0
    assert poll(11) == "" and late.targets[11].resent == 0  # past its deadline


def test_ctxt_is_answered() -> None:
    reply = Endpoint().handle(kineto.encode("ctxt", struct.pack("<iiq", 0, 5, 0)))
    assert reply[:40] == struct.pack("<Q32s", 4, b"ctxt") and struct.unpack("<i", reply[40:]) == (1,)


# -- end to end ------------------------------------------------------------------------
@contextlib.contextmanager
def _ondemand_setup(base: Path) -> Iterator[dict]:
    """An agent config in ``base`` with its own Kineto socket folder, and a job's environment."""
    # Short: a Kineto client's socket there is named dynoconfigclient<uuid> (52 bytes), and a
    # socket path has 108 at most (under pytest-xdist, basetemp gains popen-gwN/).
    sockets = Path(tempfile.mkdtemp(prefix="pa-", dir="/tmp"))
    os.chmod(sockets, 0o755)
    cfg = base / "agent.toml"
    cfg.write_text(
        f"state_dir = '{base / 'state'}'\n"  # as root the default is /var/lib/profagent
        f"[ondemand]\nsocket_dir = '{sockets}'\ncontrol_socket = '{base / 'control.sock'}'\n"
        f"trace_dir = '{base / 'traces'}'\n[stacks]\nenabled = false\n"
    )
    try:
        yield {"base": base, "sockets": sockets, "config": cfg,
               "env": {"KINETO_USE_DAEMON": "1", "KINETO_IPC_SOCKET_DIR": str(sockets)}}
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


@pytest.fixture(scope="module")
def ondemand_env(tmp_path_factory):
    with _ondemand_setup(tmp_path_factory.mktemp("ondemand")) as env:  # under /tmp, where libkineto may write
        yield env


def _trace_cli(env: dict, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profagent", "trace", "--config", str(env["config"]), *args],
                          capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def _attached(env: dict, job_args: list[str], ranks: list[str], stepping: bool = True) -> Iterator[dict]:
    """examples/train.py with ``job_args``, and an agent attached to it, once ``ranks`` poll
    it and (``stepping``) have each taken a step. A rank polls from ``import torch`` on, long
    before its loop on a loaded node: a trace of it then holds no step, nor any op."""
    out = env["base"] / "job.log"  # one attached job per set-up
    job = subprocess.Popen([sys.executable, TRAIN, *job_args], env={**os.environ, **env["env"]},
                           stdout=out.open("wb"), stderr=subprocess.DEVNULL, start_new_session=True)
    port = free_port()
    log = (env["base"] / "agent.log").open("wb")
    agent = subprocess.Popen([sys.executable, "-m", "profagent", "attach", "--pid", str(job.pid),
                              "--listen", f"127.0.0.1:{port}", "--config", str(env["config"]),
                              "--interval", "0.5"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/metrics"

    def ranks_poll() -> bool:
        samples = parse_metrics(http_get(url)).get("profagent_ondemand_processes", [])
        return sorted(lab["rank"] for lab, v in samples if v >= 1) == ranks

    try:
        wait_for(ranks_poll, timeout=60, interval=0.5, what=f"ranks {ranks} polling the agent")
        if stepping:  # each rank's own word: train.py prints "rank R step 0" after its first step
            wait_for(lambda: all(f"rank {r} step " in out.read_text() for r in ranks), timeout=60, interval=0.2,
                     what=f"ranks {ranks} stepping")
        yield {"job": job, "agent": agent, "url": url}
    finally:
        agent.terminate()
        agent.wait(timeout=10)
        kill_tree(job)
        log.close()


@pytest.fixture(scope="module")
def traced_job(ondemand_env):
    """A 2-rank job polling the agent, and the agent attached to its launcher (paced: 50 ms
    of sleep a step, as the module runs for minutes beside other tests)."""
    with _attached(ondemand_env, ["--ranks", "2", "--workers", "0", "--step-sleep", "0.05"], ["0", "1"]) as job:
        yield job


@pytest.mark.slow
def test_duration_trace_of_a_launcher_covers_both_ranks_and_is_ingested(traced_job, ondemand_env) -> None:
    # Garbage first: the endpoint must shrug it off and still serve the real processes.
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    for junk in (b"", b"\0" * 40, b"junk" * 30, struct.pack("<Q32s", 999, b"req")):
        sock.sendto(junk, str(ondemand_env["sockets"] / "dynolog"))
    sock.close()

    res = _trace_cli(ondemand_env, "--pid", str(traced_job["job"].pid), "--duration-ms", "300", "--timeout", "60")
    assert res.returncode == 0, res.stderr + res.stdout
    assert "Traceback" not in res.stderr
    files = sorted((ondemand_env["base"] / "traces").glob("profagent_*.json"))
    assert len(files) == 2, files
    assert "waiting for the next poll" in res.stderr and "ingesting" in res.stderr
    for f in files:
        assert str(f) in res.stderr  # each report names its file
    assert "steps" in res.stdout

    counted: dict[str, list] = {}

    def ingested() -> bool:
        samples = parse_metrics(http_get(traced_job["url"]))
        counted.update({name: samples.get(name, []) for name in ("profagent_traces_total",
                                                                 "profagent_ondemand_datagrams_total")})
        total = sum(v for lab, v in samples.get("profagent_traces_total", []) if lab["status"] == "ingested")
        malformed = [v for lab, v in samples.get("profagent_ondemand_datagrams_total", []) if lab["kind"] == "malformed"]
        return total >= 2 and malformed and malformed[0] >= 4

    # 60 s: a starved agent parses two MB-size traces (two suites at once on 2 cores)
    try:
        wait_for(ingested, timeout=60, what="on-demand traces ingested and junk counted")
    except BaseException:
        print("what the agent counted last:", counted)  # which of the two never came, and how each trace ended
        raise


@pytest.mark.slow
def test_iteration_trace_of_one_rank(traced_job, ondemand_env) -> None:
    tree_pids = [p.pid for p in __import__("psutil").Process(traced_job["job"].pid).children()]
    before = set((ondemand_env["base"] / "traces").glob("profagent_*.json"))
    res = _trace_cli(ondemand_env, "--pid", str(tree_pids[0]), "--iterations", "3", "--json", "--timeout", "60")
    assert res.returncode == 0, res.stderr + res.stdout
    new = set((ondemand_env["base"] / "traces").glob("profagent_*.json")) - before
    assert len(new) == 1 and f"_{tree_pids[0]}.json" in new.pop().name
    import json

    report = json.loads(res.stdout)
    [trace] = report["traces"]  # the JSON report of the new trace
    assert trace["step_source"] == "optimizer" and len(trace["steps"]) == 3  # --iterations 3: 3 steps


@pytest.mark.slow
def test_an_iteration_trace_asked_before_the_first_step_has_those_steps(tmp_path: Path) -> None:
    """A process that polls but has not stepped yet (loading its data) gets --iterations 2:
    libkineto drops the config (with a duration in it, it ran a 500 ms timed trace instead:
    no step here, 13 and 11 steps on a loaded node); the CLI says it waits for a step, and
    once the job trains the trace has exactly 2 steps."""
    go = tmp_path / "go"
    job_args = ["--workers", "0", "--step-sleep", "0.005", "--start-after", str(go)]
    with _ondemand_setup(tmp_path) as env, _attached(env, job_args, ["0"], stepping=False) as traced:
        cli = subprocess.Popen([sys.executable, "-m", "profagent", "trace", "--config", str(env["config"]),
                                "--pid", str(traced["job"].pid), "--iterations", "2", "--json", "--timeout", "120"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            err: list[str] = []
            reader = threading.Thread(target=lambda: err.extend(cli.stderr), daemon=True)
            reader.start()
            wait_for(lambda: any("waiting for an optimizer step" in line for line in err), timeout=60,
                     what="the CLI saying the job has not stepped")
            assert not list((tmp_path / "traces").glob("*.json")), "a trace before the job stepped"
            go.touch()  # the job trains
            out, _ = cli.communicate(timeout=120)
            reader.join(10)
        finally:
            if cli.poll() is None:
                cli.kill()
    assert cli.returncode == 0, "".join(err)
    [trace] = json.loads(out)["traces"]
    assert trace["step_source"] == "optimizer" and len(trace["steps"]) == 2, (trace["step_source"], trace["steps"])


@pytest.mark.slow
def test_json_of_a_launcher_is_one_document_with_the_cross_rank_summary(traced_job, ondemand_env) -> None:
    """--json prints ONE document for the whole request (every rank, then the cross-rank
    summary), not one per rank; --iterations 2 gives 2 steps on each rank."""
    import json

    res = _trace_cli(ondemand_env, "--pid", str(traced_job["job"].pid), "--iterations", "2", "--json", "--timeout", "60")
    assert res.returncode == 0, res.stderr + res.stdout
    doc = json.loads(res.stdout)  # one document: no "Extra data"
    assert sorted(t["rank"] for t in doc["traces"]) == ["0", "1"]
    assert [len(t["steps"]) for t in doc["traces"]] == [2, 2]
    ranks = doc["summary"]["ranks"]
    assert sorted(ranks) == ["0", "1"] and all(r["steps"] == 2 for r in ranks.values())
    timed = {r: v["step_seconds"] for r, v in ranks.items()}
    assert all(t > 0 for t in timed.values())
    # The straggler is judged from each rank's collectives, never from step time (#27):
    # the summary names one or says why none, in words.
    assert doc["summary"]["straggler_rank"] in (None, *ranks) and doc["summary"]["straggler_why"]
    assert doc["summary"]["spread"] == pytest.approx(max(timed.values()) / min(timed.values()) - 1)


def _aten_events(path: str) -> int:
    """Operator events in a finished trace file (0 while it is missing or being written)."""
    try:
        return sum(str(e.get("name", "")).startswith("aten::") for e in json.loads(Path(path).read_text())["traceEvents"])
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.slow
def test_a_trace_dropped_by_a_job_paused_when_it_arrived_is_sent_again(tmp_path: Path) -> None:
    """A job stopped (SIGSTOP, as a blocking py-spy dump does) just after it picked up a config
    misses libkineto's start window and drops it, saying so only in its own stderr. The
    endpoint sends it again at the job's next free poll, and the trace comes."""
    sockets = Path(tempfile.mkdtemp(prefix="pa-", dir="/tmp"))
    os.chmod(sockets, 0o755)
    endpoint = Endpoint(str(sockets))
    endpoint.bind()
    stop = threading.Event()
    threading.Thread(target=endpoint.serve, args=(stop,), daemon=True).start()
    stderr = tmp_path / "job.stderr"
    env = {**os.environ, "KINETO_USE_DAEMON": "1", "KINETO_IPC_SOCKET_DIR": str(sockets),
           "KINETO_ONDEMAND_TRACE_DIR": str(tmp_path)}
    out = tmp_path / "job.stdout"
    with stderr.open("wb") as err, out.open("wb") as printed:
        job = subprocess.Popen([sys.executable, TRAIN, "--workers", "1", "--step-sleep", "0.005"], env=env,
                               stdout=printed, stderr=err, start_new_session=True)
    try:
        wait_for(lambda: any(p.pid == job.pid for p in endpoint.pollers()), timeout=60, what="the job polling")
        # it polls from `import torch` on: a trace before its first step would hold no op
        wait_for(lambda: "rank 0 step " in out.read_text(), timeout=60, interval=0.2, what="the job stepping")
        # The job's own log is the ground truth: libkineto's drop, or a pause that came after
        # it had started the trace (then try again; the window is 1 s, the pause 2.5 s).
        for _ in range(3):
            request = endpoint.request(match_pid(job.pid), kineto.TraceOptions(duration_ms=200), str(tmp_path), 60)
            target = request.targets[job.pid]
            wait_for(lambda: target.sent_at is not None, timeout=30, interval=0.01, what="the config sent")  # noqa: B023
            time.sleep(0.1)  # the job has read it; libkineto starts it 1 to 2 s after
            os.kill(job.pid, signal.SIGSTOP)
            try:
                time.sleep(2.5)
            finally:
                os.kill(job.pid, signal.SIGCONT)
            wait_for(lambda: _aten_events(target.file), timeout=60, interval=0.2, what="the trace file")  # noqa: B023
            if "insufficient time for warmup" in stderr.read_text(errors="replace"):
                break
        else:
            pytest.fail("the job never dropped the config: each pause missed libkineto's start window")
        assert target.resent >= 1 and endpoint.counts()["resent"] >= 1
    finally:
        stop.set()
        kill_tree(job)
        endpoint.close()
        shutil.rmtree(sockets, ignore_errors=True)


def _isolated_agent(tmp_path: Path, run_agent, children):
    """An agent on a sleeping process, with private Kineto and control sockets."""
    cfg = tmp_path / "a.toml"
    cfg.write_text(f"[ondemand]\nsocket_dir = '{tmp_path / 's'}'\ncontrol_socket = '{tmp_path / 'c.sock'}'\n"
                   f"trace_dir = '{tmp_path / 't'}'\n[stacks]\nenabled = false\n")
    target = children.python("import time; time.sleep(60)")
    port = free_port()
    agent = run_agent(["attach", "--pid", str(target.pid), "--listen", f"127.0.0.1:{port}", "--config", str(cfg)])
    agent.wait_healthy(f"http://127.0.0.1:{port}")
    return agent, target, port, cfg


def test_no_registered_process_exits_2(tmp_path: Path, run_agent, children) -> None:
    agent, target, port, cfg = _isolated_agent(tmp_path, run_agent, children)
    res = _trace_cli({"config": cfg}, "--pid", str(target.pid), timeout=30)
    assert res.returncode == 2 and "KINETO_USE_DAEMON=1" in res.stderr and "Traceback" not in res.stderr
    res = _trace_cli({"config": cfg}, "--pid", "1", "--all", timeout=30)
    assert res.returncode == 2 and "exactly one of" in res.stderr


def test_no_agent_exits_2(tmp_path: Path) -> None:
    cfg = tmp_path / "a.toml"
    cfg.write_text(f"[ondemand]\ncontrol_socket = '{tmp_path / 'none.sock'}'\n")
    res = _trace_cli({"config": cfg}, "--all", timeout=30)
    assert res.returncode == 2 and "no profagent agent is running" in res.stderr


def test_name_taken_turns_the_source_off_and_the_rest_runs(tmp_path: Path, run_agent, children) -> None:
    sockets = tmp_path / "s"
    sockets.mkdir()
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    squatter.bind(str(sockets / "dynolog"))  # another daemon holds the name
    try:
        agent, target, port, cfg = _isolated_agent(tmp_path, run_agent, children)
        # /healthz said ok: every source has started or been turned off by now.
        samples = parse_metrics(http_get(f"http://127.0.0.1:{port}/metrics"))
        up = {lab["collector"]: v for lab, v in samples["profagent_collector_up"]}
        assert up["ondemand"] == 0 and up["host"] == 1
        wait_for(lambda: "held by another daemon" in agent.output, what="the one-line reason")
        assert "Traceback" not in agent.output
        # The control socket stays (for `incidents capture`); a trace request gets the reason.
        res = _trace_cli({"config": cfg}, "--all", timeout=30)
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
        assert f"on-demand tracing is off in the profagent agent PID {agent.proc.pid} (" in res.stderr
        assert "held by another daemon" in res.stderr
        from profagent.config import load_config
        from profagent.doctor.ondemand import check_ondemand as doctor_check

        row = _endpoint_row(doctor_check(load_config(cfg, {}, {})))
        assert row.status == "warn" and "has on-demand tracing off" in row.detail, row
    finally:
        squatter.close()


def test_periodic_mode_rotates_ranks_and_keeps_only_its_own_last_k(tmp_path: Path) -> None:
    from profagent.contracts import ProcessInfo, ProcessTree
    from profagent.sources.ondemand.source import OndemandSource

    now = [0.0]
    src = OndemandSource(interval=1, trace_dir=str(tmp_path), periodic_minutes=1, keep=2, clock=lambda: now[0])
    tree = ProcessTree("j", 1, tuple(
        ProcessInfo(pid, 1, 0.0, "main", str(rank), str(rank), "2", "python", "j") for rank, pid in ((0, 100), (1, 101))
    ), True)
    user_file = tmp_path / "profagent_mine_100.json"  # looks like ours, but the agent never asked for it
    user_file.write_text("{}")
    chosen = []
    for _ in range(5):
        now[0] += 61
        for pid in (100, 101):
            src.endpoint.handle(kineto.encode_poll(kineto.Poll(3, 0, (pid, 1))))
        src.collect(tree)
        # The process that got a config writes its trace where libkineto would.
        for pid in (100, 101):
            reply = src.endpoint.handle(kineto.encode_poll(kineto.Poll(3, 0, (pid, 1))))
            if reply[40:]:
                log_file = reply[40:].decode().splitlines()[0].split("=", 1)[1]
                Path(kineto.output_path(log_file, pid)).write_text("{}")
                chosen.append(pid)
    assert chosen == [100, 101, 100, 101, 100]  # one rank per period, in turn
    own = sorted(p for p in tmp_path.glob("profagent_*.json") if p != user_file)
    assert len(own) == 2  # only the last K of the agent's own traces are kept
    assert user_file.read_text() == "{}"  # the user's file is never touched


def _endpoint_row(rows: Iterable[Check]) -> Check:
    return next(r for r in rows if r.name == "Kineto endpoint")


def test_doctor_reports_a_free_endpoint(tmp_path: Path) -> None:
    from profagent.config import load_config
    from profagent.doctor.ondemand import check_ondemand as doctor_check

    cfg = load_config(None, {}, {"ondemand.socket_dir": str(tmp_path), "ondemand.control_socket": str(tmp_path / "c")})
    row = _endpoint_row(doctor_check(cfg))
    assert row.status == "ok" and "is free" in row.detail
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    squatter.bind(str(tmp_path / "dynolog"))
    try:
        row = _endpoint_row(doctor_check(cfg))
        assert row.status == "warn" and "another daemon" in row.detail
    finally:
        squatter.close()


def test_a_socket_folder_too_long_for_the_jobs_sockets_is_named_with_its_fix(caplog: pytest.LogCaptureFixture) -> None:
    """libkineto binds "<dir>/dynoconfigclient<uuid>" without checking that it fits a socket
    path (107 bytes): past 54 bytes of folder no job can poll, although the agent's own
    "<dir>/dynolog" binds. The doctor and the agent's log both say so; 54 bytes is fine."""
    from profagent.config import load_config
    from profagent.doctor.ondemand import check_ondemand as doctor_check
    from profagent.sources.ondemand.source import OndemandSource

    short = tempfile.mkdtemp(prefix="pa-", dir="/tmp")
    try:
        fits = short + "/" + "d" * (kineto.MAX_SOCKET_DIR_BYTES - len(short) - 1)
        assert len(fits) == 54
        # the longest socket path a job would bind in it: exactly the limit
        client = fits + "/dynoconfigclient" + "0" * 36
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
            os.makedirs(fits)
            probe.bind(client)  # 107 bytes: fits
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe, pytest.raises(OSError):
            probe.bind(fits + "d/dynoconfigclient" + "0" * 36)  # one byte more: refused by the kernel
        assert kineto.socket_dir_problem(fits) is None
        too_long = fits + "x"
        problem = kineto.socket_dir_problem(too_long)
        assert problem is not None and "55 bytes" in problem

        def rows(folder: str) -> dict[str, Check]:
            cfg = load_config(None, {}, {"ondemand.socket_dir": folder, "ondemand.control_socket": short + "/c"})
            return {r.name: r for r in doctor_check(cfg)}

        assert "Kineto socket folder" not in rows(fits)
        row = rows(too_long)["Kineto socket folder"]
        assert row.status == "warn" and row.detail == problem and "at most 54 bytes" in row.fix
        assert rows(too_long)["Kineto endpoint"].status == "ok"  # the agent's own socket still binds

        source = OndemandSource(1.0, short + "/traces", socket_dir=too_long)
        with caplog.at_level(logging.WARNING, logger="profagent.sources.ondemand.source"):
            source.start()
            source.stop()
        assert [r.getMessage() for r in caplog.records] == [f"{problem}; {kineto.SOCKET_DIR_FIX}"]
    finally:
        shutil.rmtree(short, ignore_errors=True)

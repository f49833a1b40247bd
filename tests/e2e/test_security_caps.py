"""Caps that hold inside the agent against an unprivileged neighbour (issue 25, items 3, 4, 5,
8, 12): a root `profagent watch` or `attach`, an attacker really running as `nobody`, and
checks that the agent is unharmed (CPU, RSS, children, watchdog pings, the victim's job)."""

from __future__ import annotations

import os
import time
import uuid

import psutil
import pytest

from helpers.agent import free_port, http_get, parse_metrics
from helpers.flood import CAN_PLAY_NOBODY, NEEDS, NOBODY_PYTHON, Flood
from helpers.processes import wait_for
from helpers.watch import job_env, token, watch_config

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not CAN_PLAY_NOBODY, reason=NEEDS)]
SLEEPER = "import time\nwhile True:\n    time.sleep(0.05)\n"


def _cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _notify_socket():
    from test_watch_notify import NotifySocket  # the same stand-in for systemd's socket

    return NotifySocket(f"@profagent-caps-{uuid.uuid4().hex}")


def test_look_alike_flood_neither_stalls_discovery_nor_the_watchdog(run_agent, children, tmp_path) -> None:
    """400 `sleep`s of nobody named like a training script (the attack used 3,000 with the
    default caps; here watch.max_new_per_scan is 8): the victim's new job is found within a
    few scans, the agent's CPU stays low, and WATCHDOG=1 keeps coming every WatchdogSec/2."""
    tok = token()
    port = free_port()
    notify = _notify_socket()
    cfg = watch_config(tmp_path, tok, cmdline_regex=rf"train_{tok}\.py", scan_interval=0.5, max_new_per_scan=8)
    flood = Flood(400, "/bin/sleep", [f"python3 train_{tok}.py", "600"])
    try:
        agent = run_agent(["watch", "--config", str(cfg), "--listen", f"127.0.0.1:{port}"],
                          env={"NOTIFY_SOCKET": notify.address, "WATCHDOG_USEC": "2000000"})
        url = f"http://127.0.0.1:{port}"
        agent.wait_healthy(url, timeout=30)

        def attacker_jobs() -> int:
            rows = parse_metrics(http_get(url + "/metrics")).get("profagent_target_up", [])
            return sum(1 for lab, v in rows if v == 1)

        # nobody's decoys fill its share of jobs (half of max_jobs) once settled
        wait_for(lambda: attacker_jobs() >= 8, timeout=60, what="nobody's decoys admitted up to its share")
        pings_before = notify.count("WATCHDOG")
        cpu_before, wall_before = _cpu_seconds(agent.proc.pid), time.monotonic()

        victim = children.python(SLEEPER, env=job_env(tok, SLURM_JOB_ID="victim-1"))
        began = time.monotonic()

        def victim_up() -> bool:
            rows = parse_metrics(http_get(url + "/metrics")).get("profagent_target_up", [])
            return any(lab.get("job_id") == "victim-1" and v == 1 for lab, v in rows)

        wait_for(victim_up, timeout=30, what="the victim's job on /metrics")
        found_after = time.monotonic() - began
        time.sleep(max(0.0, 6.0 - (time.monotonic() - wall_before)))  # observe at least 6 s
        cpu = (_cpu_seconds(agent.proc.pid) - cpu_before) / (time.monotonic() - wall_before)
        pings = notify.count("WATCHDOG") - pings_before
        elapsed = time.monotonic() - wall_before
        print(f"found after {found_after:.1f}s cpu {cpu:.0%} pings {pings} in {elapsed:.1f}s")
        assert victim.poll() is None
        assert found_after < 10, f"victim's job found after {found_after:.1f} s"
        assert cpu < 0.2, f"agent used {cpu:.0%} of a core with 400 decoys"
        # one ping a second while healthy; allow for a loaded machine, never a stall
        assert pings >= elapsed / 1.0 - 3, f"{pings} watchdog pings in {elapsed:.1f} s"
        assert "not pinging the watchdog" not in agent.output
    finally:
        flood.stop()
        notify.close()


def _rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def test_huge_job_ids_stay_bounded_labels_at_default_caps(run_agent, tmp_path) -> None:
    """4 jobs of nobody x 4 ranks, each with a distinct 120 KB SLURM_JOB_ID (the attack:
    8 x 16 gave a 188 MB /metrics and 1 GB RSS): every label value is at most
    agent.max_label_bytes (128) at its default, the four jobs stay four, /metrics stays
    small and the agent's RSS does not grow with the ids."""

    from helpers.watch import FAKE_TORCHRUN

    tok = token()
    port = free_port()
    cfg = watch_config(tmp_path, tok)  # default caps; only the discovery rule is the test's
    agent = run_agent(["watch", "--config", str(cfg), "--listen", f"127.0.0.1:{port}"])
    url = f"http://127.0.0.1:{port}"
    agent.wait_healthy(url, timeout=30)
    rss_before = _rss_mib(agent.proc.pid)
    ids = [f"{i}" + "J" * 120_000 for i in range(4)]
    flood = Flood(4, NOBODY_PYTHON, [NOBODY_PYTHON, "-c", FAKE_TORCHRUN], env=job_env(tok, NRANKS="4"),
                  each=[{"SLURM_JOB_ID": j} for j in ids], expect=20)
    try:
        def four_jobs():
            text = http_get(url + "/metrics")
            rows = parse_metrics(text).get("profagent_target_up", [])
            return text if sum(1 for lab, v in rows if v == 1) == 4 else None

        text = wait_for(four_jobs, timeout=60, what="nobody's four jobs on /metrics")
        def ranks_seen() -> int:
            rows = parse_metrics(http_get(url + "/metrics")).get("profagent_process_cpu_seconds_total", [])
            seen = {(lab["job_id"][:2], lab.get("rank")) for lab, _ in rows if lab.get("role") == "main"}
            return len(seen)

        wait_for(lambda: ranks_seen() >= 16, timeout=60, what="per-rank series of the 16 ranks")
        text = http_get(url + "/metrics")
        parsed = parse_metrics(text)
        values = {v for rows in parsed.values() for lab, _ in rows for v in lab.values()}
        assert max(len(v.encode()) for v in values) <= 128
        job_ids = {lab["job_id"] for lab, v in parsed["profagent_target_up"] if v == 1}
        assert len(job_ids) == 4  # distinct once bounded: the hash of the whole id
        assert all(j.endswith(j[-12:]) and "…" in j and len(j.encode()) == 128 for j in job_ids)
        assert {j[0] for j in job_ids} == {"0", "1", "2", "3"}
        assert len(text) < 512 * 1024, f"/metrics is {len(text)} bytes"
        rss = _rss_mib(agent.proc.pid)
        print(f"/metrics {len(text)} bytes, RSS {rss_before:.0f} -> {rss:.0f} MiB")
        assert rss - rss_before < 64, f"RSS grew from {rss_before:.0f} to {rss:.0f} MiB"
        assert "J" * 200 not in agent.output  # nor in a log line
    finally:
        flood.stop()


def _gzip_of_blanks(path, head: bytes, blank_mib: int, tail: bytes) -> None:
    """head + blank_mib MiB of spaces + tail as gzip, written in a fraction of a second: the
    blanks are compressed once per MiB with a full flush, which makes every later MiB the
    same bytes, so they are repeated rather than compressed again (CRC and size by hand)."""
    import struct
    import zlib

    block = b" " * 2**20
    c = zlib.compressobj(9, zlib.DEFLATED, -15)  # raw deflate: the gzip frame is ours
    first = c.compress(head + block) + c.flush(zlib.Z_FULL_FLUSH)
    again = c.compress(block) + c.flush(zlib.Z_FULL_FLUSH)
    assert c.compress(block) + c.flush(zlib.Z_FULL_FLUSH) == again
    crc = zlib.crc32(head)
    for _ in range(blank_mib):
        crc = zlib.crc32(block, crc)
    crc = zlib.crc32(tail, crc)
    end = c.compress(tail) + c.flush()
    size = (len(head) + blank_mib * 2**20 + len(tail)) & 0xFFFFFFFF
    with open(path, "wb") as fh:
        fh.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + first)
        for _ in range(blank_mib - 2):
            fh.write(again)
        fh.write(again + end + struct.pack("<II", crc, size))


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_gzip_bomb_in_the_default_ondemand_folder_at_default_caps(run_agent, tmp_path) -> None:
    """nobody, with a watched job of its own, drops a 1 MB .json.gz that inflates to 1 GiB of
    blanks into the on-demand folder (the attack reached 1,080 MiB RSS): the reader stops at
    traces.max_buffered_bytes (16 MiB by default), counts it, and the agent's peak RSS stays
    near its baseline."""
    import shutil
    import subprocess

    from helpers.nobody import as_nobody

    tok = token()
    port = free_port()
    folder = f"/tmp/paw-ondemand-{tok}"
    os.mkdir(folder)
    os.chmod(folder, 0o1777)
    cfg = watch_config(tmp_path, tok)
    cfg.write_text(cfg.read_text() + f'\n[ondemand]\ntrace_dir = "{folder}"\n')
    flood = Flood(1, NOBODY_PYTHON, [NOBODY_PYTHON, "-c", SLEEPER], env=job_env(tok))
    try:
        agent = run_agent(["watch", "--config", str(cfg), "--listen", f"127.0.0.1:{port}"])
        url = f"http://127.0.0.1:{port}"
        agent.wait_healthy(url, timeout=30)
        wait_for(lambda: any(v == 1 for _, v in parse_metrics(http_get(url + "/metrics")).get("profagent_target_up", [])),
                 timeout=30, what="nobody's job watched")
        baseline = _peak_rss_mib(agent.proc.pid)
        bomb = tmp_path / "bomb.json.gz"
        _gzip_of_blanks(bomb, b'{"traceEvents": [', 1024, b"]}")
        assert bomb.stat().st_size < 2 * 2**20
        target = f"{folder}/profagent_x_{flood.pids()[0]}.json.gz"
        with bomb.open("rb") as src:  # written by nobody itself
            subprocess.run(as_nobody("/bin/sh", "-c", 'cat > "$1"', "sh", target), stdin=src, check=True)
        assert os.stat(target).st_uid == 65534

        def rejected() -> float:
            rows = parse_metrics(http_get(url + "/metrics")).get("profagent_traces_rejected_total", [])
            return sum(v for lab, v in rows if lab.get("reason") == "too_large_event")

        wait_for(lambda: rejected() >= 1, timeout=60, what="the bomb counted as too_large_event")
        peak = _peak_rss_mib(agent.proc.pid)
        print(f"peak RSS {baseline:.0f} -> {peak:.0f} MiB")
        assert peak - baseline < 128, f"peak RSS {baseline:.0f} -> {peak:.0f} MiB"
        assert sum(1 for line in agent.output.splitlines() if "max_buffered_bytes" in line) == 1
        http_get(url + "/metrics")  # still serving
    finally:
        flood.stop()
        shutil.rmtree(folder, ignore_errors=True)


def test_many_ranks_never_get_more_py_spy_than_the_cap(run_agent, tmp_path) -> None:
    """A job of nobody with 12 ranks (the attack: 150 ranks gave 292 root py-spy processes):
    with stacks.max_pyspy = 3 the agent never runs more than 3, counts each wait
    (reason pyspy_cap), and still samples every rank in turn."""

    from helpers.processes import pyspy_processes
    from helpers.watch import FAKE_TORCHRUN

    tok = token()
    port = free_port()
    cfg = watch_config(tmp_path, tok)
    text = cfg.read_text().replace("[stacks]\nenabled = false", "[stacks]\nenabled = true\nwindow = 1\nmax_pyspy = 3")
    cfg.write_text(text)
    flood = Flood(1, NOBODY_PYTHON, [NOBODY_PYTHON, "-c", FAKE_TORCHRUN], env=job_env(tok, NRANKS="12"), expect=13)
    try:
        agent = run_agent(["watch", "--config", str(cfg), "--listen", f"127.0.0.1:{port}"])
        url = f"http://127.0.0.1:{port}"
        agent.wait_healthy(url, timeout=30)
        most = 0

        def sampled_ranks() -> int:
            nonlocal most
            most = max(most, len(pyspy_processes(of=agent.proc.pid)))
            rows = parse_metrics(http_get(url + "/metrics")).get("profagent_stack_samples_total", [])
            return len({lab["rank"] for lab, v in rows if lab.get("role") == "main" and v > 0})

        wait_for(lambda: sampled_ranks() == 12, timeout=90, interval=0.05, what="all 12 ranks sampled in turn")
        for _ in range(40):  # and a while longer, looking often
            most = max(most, len(pyspy_processes(of=agent.proc.pid)))
            time.sleep(0.05)
        rows = parse_metrics(http_get(url + "/metrics")).get("profagent_stack_sampler_errors_total", [])
        waits = sum(v for lab, v in rows if lab.get("reason") == "pyspy_cap")
        print(f"most py-spy at once {most}, waits {waits}")
        assert 1 <= most <= 3
        assert waits >= 9
        assert sum(1 for line in agent.output.splitlines() if "stacks.max_pyspy" in line) == 1
    finally:
        flood.stop()


def test_refused_roots_are_not_examined_again_and_users_take_turns(children, monkeypatch) -> None:
    """In-process NodeTarget: 40 look-alike processes of nobody, 2 roots examined per scan.
    Once nobody's share of jobs is full, its other roots are never examined again (no tree
    is built for them on later scans), and a new job of root is examined in the very first
    scan after it appears, ahead of nobody's backlog."""
    import profagent.target.node as node
    from profagent.target.node import Limits, NodeTarget, Rules

    built: list[int] = []

    class CountingPidTarget(node.PidTarget):
        def __init__(self, pid: int, *args, **kwargs) -> None:
            built.append(pid)
            super().__init__(pid, *args, **kwargs)

    monkeypatch.setattr(node, "PidTarget", CountingPidTarget)
    tok = token()
    rules = Rules(None, (("PAW_TOKEN", tok),), False)
    target = NodeTarget(rules, Limits(scan_interval=0.0, max_jobs=4, max_new_per_scan=2), settle_seconds=0.0,
                        self_pid=-1)
    flood = Flood(40, "/usr/bin/python3", ["/usr/bin/python3", "-c", SLEEPER], env=job_env(tok))
    try:
        decoys = set(flood.pids())
        for _ in range(40):  # 20 scans would do: 2 per scan
            target.refresh()
            if decoys <= set(built):
                break
        assert decoys <= set(built), "every decoy examined once"
        assert len(built) == len(set(built)), "none examined twice"
        assert len(decoys & {p.pid for p in target.refresh().processes}) == 2  # nobody's share: half of 4 jobs
        built.clear()
        for _ in range(5):
            target.refresh()
        assert built == [], f"refused roots examined again: {built}"
        mine = children.python(SLEEPER, env=job_env(tok, SLURM_JOB_ID="victim-2"))
        wait_for(lambda: _ready(mine.pid, tok), what="root's job started")
        tree = target.refresh()
        assert built == [mine.pid]
        assert "victim-2" in tree.job_status()
    finally:
        flood.stop()


def _ready(pid: int, tok: str) -> bool:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        return f"PAW_TOKEN={tok}".encode() in fh.read()


def test_an_incident_capture_runs_at_most_max_pyspy_dumps_at_once(tmp_path, monkeypatch) -> None:
    """A capture dumps every rank in parallel: 10 ranks under stacks.max_pyspy = 3 never
    have more than 3 dumps running (real child processes standing in for py-spy)."""
    import subprocess
    import threading

    import profagent.engine.incidents.trigger as incidents
    from profagent.config import IncidentsConfig
    from profagent.state import State

    source = incidents.IncidentsSource(IncidentsConfig(), tmp_path / "incidents", State(), max_pyspy=3)
    live, most, lock = [0], [0], threading.Lock()

    class Counted(subprocess.Popen):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            with lock:
                live[0] += 1
                most[0] = max(most[0], live[0])

        def wait(self, *args, **kwargs):  # the dump's output is read while it waits (pyspy.communicate_capped)
            try:
                return super().wait(*args, **kwargs)
            finally:
                with lock:
                    if not getattr(self, "counted_out", False):
                        self.counted_out = True
                        live[0] -= 1

    monkeypatch.setattr(incidents.subprocess, "Popen", Counted)
    threads = [threading.Thread(target=source.run_dump, args=(["/bin/sh", "-c", "sleep 1; echo Thread 1"],))
               for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert most[0] == 3 and live[0] == 0


def test_a_full_notify_queue_never_holds_the_watchdog_thread() -> None:
    """systemd's notify socket accepts datagrams from anyone; with its queue kept full, a
    ping gives up (after SEND_TIMEOUT) instead of blocking the watchdog thread for good."""
    import socket
    import threading

    from profagent.system.sdnotify import Notifier

    address = f"@profagent-full-{uuid.uuid4().hex}"
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind("\0" + address[1:])  # never read
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.setblocking(False)
    try:
        try:
            while True:
                filler.sendto(b"x" * 512, "\0" + address[1:])
        except BlockingIOError:
            pass  # the queue is full
        results: list[bool] = []
        ping = threading.Thread(target=lambda: results.append(Notifier(address, 2_000_000).watchdog()), daemon=True)
        ping.start()
        ping.join(30)
        assert not ping.is_alive() and results == [False]
    finally:
        filler.close()
        sink.close()

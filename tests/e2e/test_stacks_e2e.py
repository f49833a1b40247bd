"""End to end: the real `profagent attach` and `profagent stacks` against real Python processes."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from helpers.agent import free_port, http_get, parse_metrics, wait_for_ticks
from helpers.processes import pyspy_processes, wait_for
from helpers.prometheus import promtool_check_metrics

pytestmark = pytest.mark.slow

HOT = """
import sys
def e2e_named_hot_function():
    x = 0
    while True:
        for i in range(1000):
            x += i
open(sys.argv[0] + ".ready", "w").close()
e2e_named_hot_function()
"""


def start_hot(children, tmp_path):
    proc = children.python(HOT)
    wait_for(lambda: (tmp_path / "child_0.py.ready").exists(), 20, what="child ready")
    return proc


def pyspy_on(pid: int) -> list[psutil.Process]:
    return pyspy_processes(sampling=pid)  # anywhere: an orphan that outlived the agent counts


def test_attach_exports_stack_families_serves_folded_stacks_and_cleans_up(children, tmp_path, run_agent) -> None:
    proc = start_hot(children, tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent = run_agent(
        ["attach", "--pid", str(proc.pid), "--listen", f"127.0.0.1:{port}", "--stack-rate", "50"],
        env={"PROFAGENT_STACKS_WINDOW": "1", "PROFAGENT_INTERVAL": "0.5"},
    )
    agent.wait_healthy(url)

    def hot_counted() -> dict:
        m = parse_metrics(http_get(url + "/metrics"))
        rows = m.get("profagent_stack_function_samples_total", [])
        hit = [v for labels, v in rows if labels["function"] == "e2e_named_hot_function (child_0.py)"]
        return m if hit and hit[0] >= 20 else {}

    m = wait_for(hot_counted, 30, what="hot function counted")
    text = http_get(url + "/metrics")
    assert promtool_check_metrics(text) == ""
    labels = {tuple(sorted(lbl)) for lbl, _ in m["profagent_stack_samples_total"]}
    assert labels == {("category", "job_id", "rank", "role")}
    assert {lbl["category"] for lbl, _ in m["profagent_stack_samples_total"]} >= {"idle", "other", "forward"}
    assert [v for lbl, v in m["profagent_rank_stalled"] if lbl["rank"] == "0"] == [0.0]
    assert ({"collector": "stacks"}, 1.0) in m["profagent_collector_up"]

    folded = http_get(url + "/api/stacks?rank=0&seconds=30")
    lines = folded.strip().splitlines()
    assert lines and all(line.rsplit(" ", 1)[1].isdigit() for line in lines)
    # the main thread's OS id is the PID (py-spy names threads only once `threading` is imported)
    assert any(line.startswith(f"thread ({proc.pid})") and "e2e_named_hot_function (" in line for line in lines), folded

    # py-spy runs window after window, with a gap between them: seen running at some point
    wait_for(lambda: pyspy_on(proc.pid), 20, interval=0.1, what="the agent's py-spy on the target")
    assert agent.stop() == 0
    assert pyspy_on(proc.pid) == []
    assert "Traceback" not in agent.output
    assert psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED


def test_no_stacks_flag_turns_the_source_off(children, tmp_path, run_agent) -> None:
    proc = start_hot(children, tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    agent = run_agent(["attach", "--pid", str(proc.pid), "--listen", f"127.0.0.1:{port}", "--no-stacks"])
    agent.wait_healthy(url)
    wait_for_ticks(url, "host", 2)  # the agent has ticked since it served: only then look for stacks
    assert "profagent_stack_samples_total" not in http_get(url + "/metrics")
    assert pyspy_on(proc.pid) == []
    assert "source stacks: off" in agent.output


def test_stacks_command_writes_each_format(children, tmp_path) -> None:
    proc = start_hot(children, tmp_path)
    runs = {}
    for fmt, name in (("flamegraph", "out.svg"), ("speedscope", "out.json"), ("folded", "out.txt")):
        out = tmp_path / name
        cmd = [sys.executable, "-m", "profagent", "stacks", "--pid", str(proc.pid), "--seconds", "1",
               "--format", fmt, "-o", str(out)]
        runs[fmt] = (out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for out, run in runs.values():
        stdout, _ = run.communicate(timeout=30)
        assert run.returncode == 0, stdout
        assert f"wrote {out}" in stdout
    svg = runs["flamegraph"][0].read_text()
    assert "<svg" in svg and "e2e_named_hot_function" in svg
    speedscope = json.loads(runs["speedscope"][0].read_text())
    assert speedscope["profiles"] and any(
        f["name"] == "e2e_named_hot_function" for f in speedscope["shared"]["frames"]
    )
    folded = runs["folded"][0].read_text()
    assert "e2e_named_hot_function (child_0.py:" in folded


def test_stacks_command_bad_input_is_one_line(tmp_path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for args, needle in (
        (["--pid", str(dead.pid), "--format", "folded"], f"no process with PID {dead.pid}"),
        (["--pid", "1", "--format", "png"], "unknown format 'png'"),
    ):
        res = subprocess.run([sys.executable, "-m", "profagent", "stacks", "--seconds", "1",
                              "-o", str(tmp_path / "x"), *args], capture_output=True, text=True, timeout=30)
        assert res.returncode == 2
        err = res.stderr.strip()
        assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_ptrace_denied_turns_stacks_off_with_one_line_and_the_rest_goes_on(tmp_path) -> None:
    """A root agent without CAP_SYS_PTRACE (a container's default) beside another user's job:
    py-spy is denied, the stacks source turns off with one line, the others go on.

    The job runs as `nobody` from a world-readable folder with Debian's python3, so nothing
    of the checkout (which may sit in a 0700 folder) has to be readable by it.
    """


# HOT, with a second thread that only sleeps.
HOT_WITH_IDLE_THREAD = """
import threading, time
def e2e_idle_waiter():
    while True:
        time.sleep(0.5)
threading.Thread(target=e2e_idle_waiter, name="Waiter", daemon=True).start()
""" + HOT


def test_stacks_command_leaves_idle_threads_out_unless_asked(children, tmp_path) -> None:
    proc = children.python(HOT_WITH_IDLE_THREAD)
    wait_for(lambda: (tmp_path / "child_0.py.ready").exists(), 20, what="child ready")
    outputs = {}
    for flag in ("--no-idle", "--idle", None):
        out = tmp_path / f"folded{flag}.txt"
        cmd = [sys.executable, "-m", "profagent", "stacks", "--pid", str(proc.pid), "--seconds", "2",
               "--format", "folded", "-o", str(out), *([flag] if flag else [])]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        outputs[flag] = out.read_text()
    def samples(text: str, function: str) -> int:
        return sum(int(line.rsplit(" ", 1)[1]) for line in text.splitlines() if f";{function} (" in line)

    for text in outputs.values():  # the busy main thread is there either way
        assert samples(text, "e2e_named_hot_function") > 20
    # py-spy tells idle from running by the OS thread state, so a sleeping thread caught
    # while it wakes still counts now and then: compare, don't demand zero.
    idle = samples(outputs["--idle"], "e2e_idle_waiter")
    assert idle > 20
    assert samples(outputs["--no-idle"], "e2e_idle_waiter") < idle / 4
    assert samples(outputs[None], "e2e_idle_waiter") < idle / 4  # no idle by default


def test_unknown_option_names_the_flag_meant(tmp_path) -> None:
    # click's spelling-based guess named --rate for --duration
    for args, meant in (
        (["stacks", "--pid", "1", "-o", str(tmp_path / "x"), "--duration", "5"], "did you mean --seconds?"),
        (["attach", "--pid", "1", "--port", "19400"], "did you mean --listen?"),
        (["stacks", "--pid", "1", "-o", str(tmp_path / "x"), "--rat", "5"], "--rate"),
    ):
        res = subprocess.run([sys.executable, "-m", "profagent", *args], capture_output=True, text=True, timeout=30)
        err = res.stderr.strip()
        assert res.returncode == 2 and len(err.splitlines()) == 1, err
        assert meant in err and "No such option" in err
    res = subprocess.run([sys.executable, "-m", "profagent", "stacks", "--duration", "5"], capture_output=True, text=True, timeout=30)
    assert "--rate" not in res.stderr


SLEEPER = """
import signal, sys
open(sys.argv[0] + ".ready", "w").close()
signal.pause()  # asleep for good: a loop of sleeps would wake into a window now and then
"""


def test_stacks_command_on_an_idle_process_says_idle_and_leaves_no_file(children, tmp_path) -> None:
    """Every thread asleep: without --idle py-spy keeps no sample. The one line says so and
    names --idle (not "is it a Python process?"), and no file is left, nor is an existing
    output truncated; with --idle the same process records fine."""
    proc = children.python(SLEEPER)
    wait_for(lambda: (tmp_path / "child_0.py.ready").exists()
             and psutil.Process(proc.pid).status() == psutil.STATUS_SLEEPING, 20, what="child asleep in pause()")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "kept.txt").write_text("the user's earlier recording\n")
    for fmt, name in (("flamegraph", "new.svg"), ("folded", "kept.txt"), ("speedscope", "new.json")):
        res = subprocess.run([sys.executable, "-m", "profagent", "stacks", "--pid", str(proc.pid), "--seconds", "1",
                              "--format", fmt, "-o", str(out_dir / name)], capture_output=True, text=True, timeout=60)
        err = res.stderr.strip()
        assert res.returncode == 2, (fmt, res.stdout, err)
        assert "no running Python code" in err and "--idle" in err and len(err.splitlines()) == 1, err
        assert "Python process" not in err and "Traceback" not in err
    assert sorted(p.name for p in out_dir.iterdir()) == ["kept.txt"]  # no SVG, no partial file
    assert (out_dir / "kept.txt").read_text() == "the user's earlier recording\n"
    res = subprocess.run([sys.executable, "-m", "profagent", "stacks", "--pid", str(proc.pid), "--seconds", "1",
                          "--idle", "-o", str(out_dir / "idle.svg")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "<svg" in (out_dir / "idle.svg").read_text()
    assert sorted(p.name for p in out_dir.iterdir()) == ["idle.svg", "kept.txt"]

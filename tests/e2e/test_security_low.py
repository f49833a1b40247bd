"""#13 low items, played for real: directories where files belong, a JSON nested a million
deep, py-spy folders left by a SIGKILLed agent, `nobody` attaching to root's job, and the
secrets of a command line on /metrics."""

from __future__ import annotations

import contextlib
import io
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from helpers.agent import free_port, http_get, parse_metrics
from helpers.processes import kill_tree, pyspy_processes, wait_for
from profagent.sources.stacks.sampler import TMP_PREFIX, remove_stale_folders

NOBODY = 65534
SLEEPER = "import sys, time\nopen(sys.argv[0] + '.ready', 'w').close()\nwhile True:\n    sum(range(3000)); time.sleep(0.01)\n"


def _profagent(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "profagent", *args], capture_output=True, text=True, timeout=timeout)


def _one_line_exit_2(res: subprocess.CompletedProcess, needle: str) -> None:
    err = res.stderr.strip()
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert needle in err, err


@pytest.mark.parametrize(("flag", "needle"), [("--config", "config file"), ("--web-config", "web config")])
def test_a_directory_where_a_file_belongs_is_one_line(tmp_path: Path, flag: str, needle: str) -> None:
    res = _profagent("attach", "--pid", str(os.getpid()), "--listen", "127.0.0.1:0", flag, str(tmp_path))
    _one_line_exit_2(res, f"{needle} {tmp_path} is a directory")


def test_analyze_a_json_nested_a_million_deep(tmp_path: Path) -> None:
    bomb = tmp_path / "deep.pt.trace.json"
    bomb.write_bytes(b"[" * 10**6)
    for target in (bomb, tmp_path):  # the file, and the folder holding it
        res = _profagent("analyze", str(target))
        assert res.returncode == 2, res.stderr
        assert "Traceback" not in res.stderr and "RecursionError" not in res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 2 and "nested too deeply" in lines[0], res.stderr  # the file, then the total
    # nested inside the events array as well
    bomb.write_bytes(b'{"traceEvents": ' + b"[" * 10**6)
    res = _profagent("analyze", str(bomb))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr


@pytest.mark.slow
def test_py_spy_folders_of_a_sigkilled_agent_are_removed_at_start(children, run_agent, tmp_path: Path) -> None:
    proc = children.python(SLEEPER)
    wait_for(lambda: (tmp_path / "child_0.py.ready").exists(), what="child ready")
    port = free_port()
    agent = run_agent(["attach", "--pid", str(proc.pid), "--listen", f"127.0.0.1:{port}"],
                      env={"PROFAGENT_STACKS_WINDOW": "1"})
    agent.wait_healthy(f"http://127.0.0.1:{port}")
    tmp = Path(tempfile.gettempdir())

    def its_folder() -> list[Path]:
        return [p for p in tmp.glob(f"{TMP_PREFIX}{agent.proc.pid}-*") if p.is_dir()]

    left = wait_for(its_folder, what="the agent's py-spy folder")[0]
    wait_for(lambda: any(left.iterdir()), what="py-spy output in it")
    # what must survive: a live agent's folder (ours), someone else's, a symlink, a foreign name
    me = psutil.Process()
    live = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{me.pid}-{round(me.create_time() * 1000)}-"))
    # Someone else's stale-looking folder: only root can make one. As another user the
    # folder is our own and must go (same name rule), which is checked instead.
    foreign = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}1-1-"))
    as_root = os.geteuid() == 0
    if as_root:
        os.chown(foreign, NOBODY, NOBODY)
    victim = Path(tempfile.mkdtemp(prefix="paw-victim-"))
    (victim / "keep").write_text("x")
    link = tmp / f"{TMP_PREFIX}2-2-link"
    link.symlink_to(victim)
    old = time.time() - 60
    for path in (live, foreign):
        os.utime(path, (old, old))
    try:
        os.kill(agent.proc.pid, signal.SIGKILL)
        agent.proc.wait()
        time.sleep(0.05)
        assert left.is_dir()  # the SIGKILLed agent could not clean up
        removed = remove_stale_folders(tmp, time.time())
        assert left in removed and not left.exists()
        assert live.is_dir() and link.is_symlink() and (victim / "keep").exists()
        assert foreign.is_dir() if as_root else (foreign in removed and not foreign.exists())
    finally:
        for path in (live, foreign, victim):
            subprocess.run(["rm", "-rf", str(path)], check=False)
        link.unlink(missing_ok=True)
        for p in pyspy_processes(of=os.getpid()):  # py-spy of the killed agent
            with contextlib.suppress(psutil.Error):
                p.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="plays nobody against root: needs root")
def test_nobody_attaching_to_a_root_pid_is_refused(children, tmp_path: Path, monkeypatch) -> None:
    """The real CLI runs as nobody (forked and setuid: nobody cannot read the venv under /root)."""
    import profagent.cli as cli

    target = children.python(SLEEPER)
    argv = ["profagent", "attach", "--pid", str(target.pid), "--listen", "127.0.0.1:0"]
    warm = [*argv[:3], "1", *argv[4:]]  # imports what parsing loads lazily, while still root
    monkeypatch.setattr(sys, "argv", warm)
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        cli.main()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.dup2(write, 1)
            os.dup2(write, 2)
            sys.stdout = sys.stderr = open(write, "w", buffering=1, closefd=False)  # noqa: SIM115 - pytest swapped them; the child _exits
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.chdir("/")
            sys.argv = argv
            cli.main()
            code = 0
        except SystemExit as exc:
            sys.stderr.flush()
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            os._exit(code)
    os.close(write)
    out = b""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([read], [], [], 1.0)
            if ready:
                data = os.read(read, 65536)
                if not data:
                    break
                out += data
        else:
            pytest.fail(f"the agent started as nobody on root's PID: {out!r}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        _, status = os.waitpid(child, 0)
        os.close(read)
    text = out.decode().strip()
    assert "Traceback" not in text and len(text.splitlines()) == 1, text
    assert f"not permitted to read PID {target.pid} (owned by root)" in text
    assert os.waitstatus_to_exitcode(status) == 2


@pytest.mark.slow
@pytest.mark.parametrize("with_args", [False, True])
def test_metrics_carry_no_secret_from_the_command_line(run_agent, tmp_path: Path, with_args: bool) -> None:
    script = tmp_path / "train.py"
    script.write_text(SLEEPER)
    proc = subprocess.Popen([sys.executable, "train.py", "--api-key=SECRET123", "--password", "hunter2", "--lr", "0.1"],
                            start_new_session=True, cwd=tmp_path)
    try:
        wait_for(lambda: (tmp_path / "train.py.ready").exists(), what="job ready")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {"PROFAGENT_STACKS_ENABLED": "false", "PROFAGENT_CMDLINE_ARGS": "true" if with_args else "false"}
        agent = run_agent(["attach", "--pid", str(proc.pid), "--listen", f"127.0.0.1:{port}"], env=env)
        agent.wait_healthy(url)

        def info() -> list[str]:
            return [lab["cmdline"] for lab, _ in parse_metrics(http_get(url + "/metrics")).get("profagent_target_info", [])]

        cmdlines = wait_for(info, what="profagent_target_info")
        text = http_get(url + "/metrics") + http_get(url + "/api/ranks")
    finally:
        kill_tree(proc)
    assert "SECRET123" not in text and "hunter2" not in text
    if with_args:
        assert cmdlines == [f"{Path(sys.executable).name} train.py --api-key=*** --password *** --lr 0.1"], cmdlines
    else:
        assert cmdlines == [f"{Path(sys.executable).name} train.py"], cmdlines

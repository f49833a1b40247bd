"""Issue 41 items 12 and 13 played by ``nobody`` with a watched job of its own (they were
unit-tested, and tested with root's own child).

nobody's job runs with ``--api-key SECRET`` on its command line and writes a trace of its
own into the on-demand folder, whose file name and op names carry terminal escapes. A root
``profagent watch`` ingests the trace and captures an incident of the job. Bounds: no raw
ESC or BEL byte in ``/metrics`` (the op names are there, escaped, so the test sees they got
through), and the secret is in no file of the bundle, whose ``stacks-rank0.txt`` shows the
redacted command line in place of py-spy's ``Process N: <command line>`` line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import urllib.request
from pathlib import Path

import pytest

from helpers.agent import free_port, http_get, parse_metrics
from helpers.nobody import NOBODY, as_nobody
from helpers.processes import kill_tree, wait_for
from helpers.watch import token

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                       reason="plays a root agent against nobody: needs root and setpriv"),
]

SECRET = "SECRET-41-13-nobody"
JOB = "import time\nwhile True:\n    sum(range(3000))\n    time.sleep(0.02)\n"
ESC_OP = "\x1b[2J\x1b]0;PWNED\x07aten::"  # every aten:: op of the trace is named so
WRITE = "import os, sys\nd, name = sys.argv[1], sys.argv[2]\ntmp = os.path.join(d, '.t.tmp')\n" \
        "open(tmp, 'w').write(sys.stdin.read())\nos.rename(tmp, os.path.join(d, name))\n"


def test_nobodys_escapes_and_secret_reach_neither_metrics_nor_the_bundle(run_agent, tmp_path: Path) -> None:
    from test_security_attribution import trace_of

    tok = token()
    folder = Path(f"/tmp/paw-names-{tok}")
    folder.mkdir()
    folder.chmod(0o1777)
    scripts = Path(tempfile.mkdtemp(prefix="paw-names-scripts-"))
    scripts.chmod(0o755)
    (scripts / "job.py").write_text(JOB)
    (scripts / "job.py").chmod(0o644)
    config = tmp_path / "agent.toml"
    config.write_text(textwrap.dedent(f"""\
        interval = 0.3
        state_dir = '{tmp_path / "state"}'
        [gpu]
        backend = "off"
        [timeline]
        enabled = false
        [watch]
        cmdline_regex = ""
        env_markers = ["PAW_TOKEN={tok}"]
        gpu_processes = false
        scan_interval = 0.3
        [ondemand]
        socket_dir = '{tmp_path}'
        control_socket = '{tmp_path / "c.sock"}'
        trace_dir = '{folder}'
        [incidents]
        dir = '{tmp_path / "incidents"}'
        capture_timeout = 10
        rate_limit_seconds = 0
        """))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    job = subprocess.Popen(as_nobody("/usr/bin/python3", str(scripts / "job.py"), "--api-key", SECRET),
                           env={"PATH": "/usr/bin:/bin", "PAW_TOKEN": tok, "SLURM_JOB_ID": "nobody-41-12",
                                "RANK": "0", "WORLD_SIZE": "1"}, start_new_session=True)
    try:
        wait_for(lambda: os.stat(f"/proc/{job.pid}").st_uid == NOBODY, what="nobody's job")
        agent = run_agent(["watch", "--config", str(config), "--listen", f"127.0.0.1:{port}"])
        agent.wait_healthy(url, timeout=60)
        wait_for(lambda: any(lab.get("job_id") == "nobody-41-12" for lab, v in parse_metrics(
            http_get(url + "/metrics")).get("profagent_target_up", [])), 30, what="nobody's job watched")
        wait_for(lambda: any(lab.get("job_id") == "nobody-41-12" for lab, v in parse_metrics(
            http_get(url + "/metrics")).get("profagent_stack_samples_total", [])), 60, what="nobody's job sampled")

        trace = trace_of(job.pid).replace('"aten::', json.dumps(ESC_OP)[:-1])
        assert any(e.get("name", "").startswith(ESC_OP) for e in json.loads(trace)["traceEvents"])
        name = f"profagent_\x1b]0;PWNED\x07_{job.pid}.json"
        wrote = subprocess.run(as_nobody("/usr/bin/python3", "-c", WRITE, str(folder), name), input=trace,
                               text=True, capture_output=True, timeout=60)
        assert wrote.returncode == 0, wrote.stderr
        wait_for(lambda: any(lab.get("status") == "ingested" and v >= 1 for lab, v in parse_metrics(
            http_get(url + "/metrics")).get("profagent_traces_total", [])), 60, what="nobody's trace ingested")
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            raw = resp.read()
        assert b"\x1b" not in raw and b"\x07" not in raw
        assert b"x1b[2J" in raw and b"aten::" in raw  # the op names got there, escaped

        capture = subprocess.run([sys.executable, "-m", "profagent", "incidents", "capture", "--config", str(config),
                                  "--job", "nobody-41-12", "--wait", "0"], capture_output=True, text=True, timeout=60)
        assert capture.returncode == 0, capture.stderr
        done = wait_for(lambda: [i for i in json.loads(http_get(url + "/api/incidents"))["incidents"]
                                 if i["job_id"] == "nobody-41-12" and i["status"] == "complete"], 90,
                        interval=0.3, what="the incident of nobody's job")
        bundle = Path(done[0]["path"])
        stacks = (bundle / "stacks-rank0.txt").read_text()
        assert f"Process {job.pid}: python3 job.py\n" in stacks and "<module>" in stacks, stacks[:500]
        assert not [p.name for p in bundle.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    finally:
        kill_tree(job)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(scripts, ignore_errors=True)

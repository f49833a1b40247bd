"""node_exporter's spellings work: `--web.listen-address` and `--web.config.file` are
aliases of `--listen` and `--web-config` (../shared/CONVENTIONS.md, Command line)."""

from __future__ import annotations

import base64
import urllib.error
from pathlib import Path

import bcrypt
import pytest

from helpers.agent import free_port, http_get
from helpers.processes import wait_for


@pytest.mark.slow
@pytest.mark.parametrize("equals", [False, True], ids=["space", "equals"])
def test_node_exporter_flags_serve_with_the_web_config(children, run_agent, tmp_path: Path, equals: bool) -> None:
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  prom: '{bcrypt.hashpw(b'pw', bcrypt.gensalt(rounds=4)).decode()}'\n")
    job = children.python("import time\ntime.sleep(120)\n")
    port = free_port()
    listen, config = f"127.0.0.1:{port}", str(web)
    flags = ([f"--web.listen-address={listen}", f"--web.config.file={config}"] if equals
             else ["--web.listen-address", listen, "--web.config.file", config])
    agent = run_agent(["attach", "--pid", str(job.pid), "--no-stacks", *flags],
                      env={"PROFAGENT_GPU_BACKEND": "off", "PROFAGENT_STATE_DIR": str(tmp_path / "state")})
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": "Basic " + base64.b64encode(b"prom:pw").decode()}

    def healthy() -> bool:  # at the address given with --web.listen-address
        assert agent.proc.poll() is None, agent.output
        return http_get(base + "/healthz", timeout=2, headers=auth).strip() == "ok"

    wait_for(healthy, 30, what="agent /healthz")
    with pytest.raises(urllib.error.HTTPError) as denied:  # the web config from --web.config.file is in force
        http_get(base + "/metrics")
    assert denied.value.code == 401
    assert "profagent_build_info" in http_get(base + "/metrics", headers=auth)

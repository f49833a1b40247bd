"""Helpers for the watch-mode tests: fake training jobs and a watch agent with test-only rules.

Other engineers' tests run on the same machine, so every watch agent here discovers
processes only by a marker unique to the test (``PAW_TOKEN=<random>``), never by the
default command-line rule.
"""

from __future__ import annotations

import uuid
from pathlib import Path

# A torchrun-like launcher: two rank children with RANK/LOCAL_RANK/WORLD_SIZE, then it
# waits. LIFETIME (seconds) ends the job; RANK_ENV adds "K=V,K=V" to the ranks only.
FAKE_TORCHRUN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
rank_code = "import time\\nwhile True:\\n    sum(range(3000)); time.sleep(0.05)"
extra = dict(kv.split("=", 1) for kv in os.environ.get("RANK_ENV", "").split(",") if kv)
kids = []
for r in range(int(os.environ.get("NRANKS", "2"))):
    env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=os.environ.get("NRANKS", "2"), **extra)
    kids.append(subprocess.Popen([sys.executable, "-c", rank_code], env=env))
deadline = time.monotonic() + float(os.environ.get("LIFETIME", "3600"))
try:
    while time.monotonic() < deadline:
        time.sleep(0.05)
finally:
    for k in kids:
        k.kill()
    for k in kids:
        k.wait()
"""


def token() -> str:
    return uuid.uuid4().hex[:12]


def watch_config(tmp: Path, tok: str, **watch: object) -> Path:
    """A config file whose only discovery rule is PAW_TOKEN=tok."""
    settings = {"cmdline_regex": "", "env_markers": [f"PAW_TOKEN={tok}"], "gpu_processes": False,
                "scan_interval": 0.3, "grace_seconds": 2.0, **watch}
    lines = ["interval = 0.3", "", "[gpu]", 'backend = "off"', "", "[stacks]", "enabled = false", "", "[watch]"]
    for key, value in settings.items():
        if isinstance(value, str):
            lines.append(f"{key} = {_quote(value)}")
        elif isinstance(value, list):
            lines.append(f"{key} = [{', '.join(_quote(v) for v in value)}]")
        elif isinstance(value, bool):
            lines.append(f"{key} = {'true' if value else 'false'}")
        else:
            lines.append(f"{key} = {value}")
    path = tmp / f"watch-{tok}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _quote(value: object) -> str:
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def job_env(tok: str, **env: str) -> dict[str, str]:
    """The environment of a job the test's agent must find."""
    return {"PAW_TOKEN": tok, "LIFETIME": "3600", **env}


def samples(parsed: dict, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    return [(lab, v) for lab, v in parsed.get(name, []) if all(lab.get(k) == w for k, w in labels.items())]


def job_series(parsed: dict) -> list[tuple[str, dict[str, str]]]:
    """Every series labelled with a job. (Sources that still label by the tree's single
    ``job_id`` give ``job_id=""`` in watch mode: node-level, bounded, left out here.)"""
    return [(name, lab) for name, rows in parsed.items() for lab, _ in rows if lab.get("job_id")]


"""A real Prometheus server, and promtool's check of an exposition."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

import pytest

from helpers.agent import free_port, http_get
from helpers.processes import stop_process, wait_for


class Prometheus:
    """A real Prometheus server on 127.0.0.1 scraping the given targets every second."""

    def __init__(
        self, targets: list[str], tmp: Path, scheme: str = "http", rule_files: Sequence[Path] = (),
        data_dir: Path | None = None, args: Sequence[str] = (),
    ) -> None:
        """``rule_files`` are loaded too, evaluated every second like the scrape. ``data_dir``:
        an existing TSDB to serve (backfilled blocks), instead of a fresh one; ``args``: more
        command-line flags (e.g. ``--storage.tsdb.retention.time``)."""
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus is not installed: `make test` installs Debian's package")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = tmp / "prometheus.yml"
        targets_yaml = ", ".join(f"'{t}'" for t in targets)
        rules = "".join(f"  - '{path}'\n" for path in rule_files)
        cfg.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            + (f"rule_files:\n{rules}" if rules else "")
            + "scrape_configs:\n  - job_name: profagent\n"
            f"    scheme: {scheme}\n    static_configs:\n      - targets: [{targets_yaml}]\n"
        )
        data = data_dir if data_dir is not None else Path(tempfile.mkdtemp(dir=tmp, prefix="prom-data-"))
        self.log_path = tmp / "prometheus.log"
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={data}",
             f"--web.listen-address=127.0.0.1:{self.port}", *args],
            stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT,
        )
        wait_for(lambda: http_get(self.url + "/-/ready", timeout=1), 30, what="prometheus ready")

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query, at ``at`` (Unix time) or now: queries that compare counts over
        a range evaluate at one time, or the range slides by a scrape between them."""
        when = f"&time={at:.3f}" if at is not None else ""
        body = json.loads(http_get(f"{self.url}/api/v1/query?query={quote(expr)}{when}"))
        assert body["status"] == "success", body
        return body["data"]["result"]

    def stop(self) -> None:
        stop_process(self.proc)


def promtool_check_metrics(text: str) -> str:
    """Run `promtool check metrics` on an exposition; returns what it printed (empty = clean)."""
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is not installed: `make test` installs Debian's prometheus package")
    res = subprocess.run([binary, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
    return (res.stdout + res.stderr).decode().strip()

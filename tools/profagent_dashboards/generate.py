"""Regenerate the committed dashboards (needs grafana-foundation-sdk, a test/dev dependency).

    python -m profagent_dashboards.generate [DIR]   # default: the checkout's dashboards/
    make dashboards
"""

from __future__ import annotations

import sys
from pathlib import Path

from profagent.assets import asset_dir
from profagent.exporters.grafana.provisioning import (
    DATASOURCE_FILE,
    PROVIDER_FILE,
    datasource_yaml,
    provider_yaml,
)
from profagent_dashboards import agent, cluster, gpus, overview, stacks, traces
from profagent_dashboards.common import BOARDS, dumps, finish

BUILDERS = {
    "overview": overview.build,
    "gpus": gpus.build,
    "stacks": stacks.build,
    "traces": traces.build,
    "agent": agent.build,
    "cluster": cluster.build,
}


def dashboards() -> dict[str, dict]:
    """File name -> dashboard model, for every profagent dashboard."""
    return {board.filename: finish(BUILDERS[board.key]()) for board in BOARDS}


def files() -> dict[str, str]:
    """Relative path -> text of every generated file (dashboards and provisioning)."""
    out = {name: dumps(model) for name, model in dashboards().items()}
    out[DATASOURCE_FILE] = datasource_yaml()
    out[PROVIDER_FILE] = provider_yaml()
    return out


def write(root: Path) -> list[Path]:
    """Write every generated file under ``root``; returns the paths written."""
    written = []
    for rel, text in files().items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else asset_dir("dashboards")
    for path in write(root):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

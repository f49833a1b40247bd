"""Every command's ``--help`` and a few error lines are unchanged by the layout change.

How the golden file was produced (once, from the commit before the layout change, 2202f00,
where the typer app was ``profagent.cli.app`` as it is now)::

    git worktree add /tmp/old 2202f00
    PYTHONPATH=/tmp/old/src python tests/unit/test_cli_golden.py --write

Regenerate it only when a help text or message legitimately changes, and say why in the
commit (``PYTHONPATH=src python tests/unit/test_cli_golden.py --write``). Since the layout
change it was regenerated once, on purpose, for the new commands (top, diagnose,
incidents), `stacks --idle`, and `analyze` taking folders; and once more for typer 0.28
(pinned for start-up time), whose help omits the ``<bool>`` that 0.29 printed after flags; and once for click's plain
help (``rich_markup_mode=None``, for start-up time) with a short help per command; for
the new ``diff`` command (its help and its one-line error); and once for #23: `incidents
show` names its argument ``ID`` (not ``incident_id``) and `stacks --idle` shows its default once;
and for #39: `diagnose --prometheus`; and for #42: one client, so `top`, `diagnose` and
`incidents list/show` take the same --basic-auth, --basic-auth-file, --ca-file and --insecure;
and for #54: the new `timeline` command (its help and its one-line error).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

GOLDEN = Path(__file__).parent / "golden" / "cli.json"
ENV = {"COLUMNS": "100", "TERMINAL_WIDTH": "100", "NO_COLOR": "1", "TERM": "dumb"}

HELP = [
    [], ["attach"], ["watch"], ["install-service"], ["stacks"], ["config"], ["doctor"],
    ["analyze"], ["trace"], ["dashboards"], ["dashboards", "export"], ["dashboards", "push"],
    ["top"], ["diagnose"], ["diff"], ["timeline"], ["incidents"], ["incidents", "list"], ["incidents", "show"], ["incidents", "capture"],
]
# Bad input: one line naming the problem and the fix, exit 2, no traceback.
ERRORS = [
    ["analyze", "/nonexistent/trace.json"],
    ["diff", "/nonexistent/baseline.json", "/nonexistent/current.json"],
    ["config", "--config", "/nonexistent/config.toml"],
    ["attach", "--pid", "999999999"],
    ["stacks", "--pid", "999999999", "-o", "/nonexistent/flame.svg"],
    ["trace"],
    ["trace", "--pid", "1", "--all"],
    ["attach", "--pid", "1", "--gpu-backend", "cuda"],
    ["timeline", "--prometheus", "http://127.0.0.1:1"],
]


def run(args: list[str]) -> dict[str, object]:
    from profagent.cli import app

    result = CliRunner().invoke(app, args, prog_name="profagent", env=ENV)
    return {"exit_code": result.exit_code, "output": result.output}


def run_main(args: list[str]) -> dict[str, object]:
    """Through ``profagent.cli:main`` (the console script), which turns a UserError into one line."""
    done = subprocess.run(
        [sys.executable, "-m", "profagent", *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, **ENV},
    )
    return {"exit_code": done.returncode, "stdout": done.stdout, "stderr": done.stderr}


def outputs() -> dict[str, dict[str, object]]:
    cases = {" ".join([*args, "--help"]): run([*args, "--help"]) for args in HELP}
    cases.update({" ".join(args): run_main(args) for args in ERRORS})
    return cases


GOLDEN_CASES: dict[str, dict[str, object]] = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


@pytest.mark.parametrize("command", sorted(GOLDEN_CASES))
def test_command_output_matches_the_golden_file_from_before_the_layout_change(command: str) -> None:
    args = command.split()
    assert (run(args) if "--help" in args else run_main(args)) == GOLDEN_CASES[command]


def test_the_golden_file_covers_every_command() -> None:
    import typer

    from profagent.cli import app

    names = set(typer.main.get_command(app).commands)
    assert names == {k.split()[0] for k in GOLDEN_CASES if k != "--help"}
    assert all(c["exit_code"] == 2 for k, c in GOLDEN_CASES.items() if "--help" not in k)


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    GOLDEN.write_text(json.dumps(outputs(), indent=1, ensure_ascii=False) + "\n")

"""``profagent.__main__``: ``python -m profagent`` runs the CLI; importing the module does not."""

from __future__ import annotations

import subprocess
import sys


def test_importing_main_runs_nothing() -> None:
    # argv that would make the CLI print the configuration (or its usage) if it ran
    code = "import sys; sys.argv = ['profagent', 'config']; import profagent.__main__; print('imported')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "imported\n" and res.stderr == ""


def test_python_m_profagent_runs_the_cli() -> None:
    res = subprocess.run([sys.executable, "-m", "profagent", "config"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("listen = ")

"""Module docstrings say what a module is and why in a few lines: none in src/ runs past
``MAX_LINES``. Detail lives next to the code it describes, or in docs/."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers.paths import ROOT

PACKAGE = ROOT / "src" / "profagent"
MAX_LINES = 15


def docstring_lines(path: Path) -> int:
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path)))
    return len(doc.splitlines()) if doc else 0


def test_no_module_docstring_runs_past_fifteen_lines() -> None:
    sizes = {str(p.relative_to(ROOT)): docstring_lines(p) for p in sorted(PACKAGE.rglob("*.py"))}
    assert len(sizes) > 60 and sum(1 for n in sizes.values() if n) > 60  # the package was read
    assert {p: n for p, n in sizes.items() if n > MAX_LINES} == {}


def test_the_count_is_of_the_docstring_lines(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""One.\n\nThree.\n"""\n\n# a comment is not counted\nx = 1\n')
    assert docstring_lines(module) == 3
    module.write_text("x = 1\n")
    assert docstring_lines(module) == 0

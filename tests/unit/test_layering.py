"""The package's layering and the absence of import cycles, read from the source with ast.

Every import counts, module-level or inside a function, so a lazy import cannot hide a
cycle or a layering breach. Ruff's banned-api rule (TID251, with a ruff.toml in
``analysis/`` and ``sources/``) reports the same breaches in the editor; this test also
finds cycles, which ruff cannot.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import pytest

from helpers.paths import ROOT

SRC = ROOT / "src"
PACKAGE = SRC / "profagent"

# OS access goes through sources/, system/, target/ and the engine, never through analysis.
OS_MODULES = {"os", "socket", "subprocess", "psutil", "pynvml", "signal", "shutil", "ctypes", "fcntl", "select", "threading"}
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "profagent.analysis": ("profagent.sources", "profagent.exporters", "profagent.engine", "profagent.target",
                           "profagent.system", "profagent.doctor", "profagent.state"),
    "profagent.sources": ("profagent.exporters", "profagent.engine", "profagent.doctor"),
    "profagent.target": ("profagent.sources", "profagent.exporters", "profagent.engine", "profagent.doctor"),
    "profagent.system": ("profagent.analysis", "profagent.sources", "profagent.exporters", "profagent.engine",
                         "profagent.doctor"),
    "profagent.exporters": ("profagent.engine", "profagent.doctor"),
    "profagent.doctor": ("profagent.engine", "profagent.exporters"),
}


# The ground floor: modules every floor may import, which import nothing but each other.
GROUND = {"profagent.errors", "profagent.config", "profagent.labels", "profagent.contracts"}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports (absolute names), wherever the import statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # a submodule, maybe
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a package counts as its __init__)."""
    return {name: set(deps) for name, deps in _graph().items()}


@functools.cache
def _graph() -> dict[str, frozenset[str]]:  # parsed once per test session
    mods = modules()
    return {name: frozenset(m for m in imports(name, path) if m in mods and m != name) for name, path in mods.items()}


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_graph_is_read() -> None:
    g = graph()
    assert len(g) > 60 and "profagent.engine.agent" in g
    assert "profagent.exporters.exposition" in g["profagent.engine.agent"]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layering(package: str) -> None:
    breaches = sorted(
        f"{name} imports {dep}"
        for name, deps in graph().items() if under(name, package)
        for dep in deps if any(under(dep, banned) for banned in FORBIDDEN[package])
    )
    assert breaches == []


def test_analysis_does_no_io() -> None:
    breaches = sorted(
        f"{name} imports {dep}"
        for name, path in modules().items() if under(name, "profagent.analysis")
        for dep in imports(name, path) if dep.split(".")[0] in OS_MODULES
    )
    assert breaches == []


def test_nothing_outside_cli_imports_cli() -> None:
    """``python -m profagent`` (__main__) is the CLI's entry point, the one exception."""
    assert sorted(
        f"{name} imports {dep}" for name, deps in graph().items()
        if not under(name, "profagent.cli") and name != "profagent.__main__"
        for dep in deps if under(dep, "profagent.cli")
    ) == []


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle through project modules (a package importing its own submodules is
    not one: importing ``a.b`` runs ``a`` first anyway), or None."""
    sys.setrecursionlimit(10_000)
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(g[node]):
            if under(node, dep):  # a submodule naming its parent package
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(g):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "a.x": {"a"}}) is None


def test_no_import_cycles() -> None:
    assert find_cycle(graph()) is None


@pytest.mark.parametrize("module", sorted(GROUND))
def test_the_ground_floor_imports_only_the_ground_floor(module: str) -> None:
    """The data contracts (contracts.py) and labels.py among them: any floor can read them."""
    assert sorted(graph()[module] - GROUND) == []


def test_analysis_reads_the_sources_data_through_the_contracts() -> None:
    """The analyzers take typed snapshots from contracts.py, never from a source's module."""
    g = graph()
    assert "profagent.contracts" in g["profagent.analysis.findings.evaluate"]
    assert "profagent.contracts" in g["profagent.analysis.findings.inputs"]
    assert not [m for m, deps in g.items() if under(m, "profagent.analysis") and any(under(d, "profagent.sources") for d in deps)]

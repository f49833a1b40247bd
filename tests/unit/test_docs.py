"""The docs match the code: every path and ``python -m`` module the docs name exists,
and docs/metrics.md's tables give the families and labels that the golden exposition
(tests/unit/golden/) holds. test_docs_readme.py holds the README and the rest.

Run as a script with a file to see what the checks extract from it
(``python tests/unit/test_docs.py README.md``).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from helpers.paths import ROOT

DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
GOLDEN = ROOT / "tests" / "unit" / "golden" / "exposition.txt"
METRICS = ROOT / "docs" / "metrics.md"
PACKAGE = ROOT / "src" / "profagent"


def test_every_family_in_the_code_is_in_docs_metrics() -> None:
    families = set()
    for module in (ROOT / "src" / "profagent" / "exporters" / "families").glob("*.py"):
        families |= set(re.findall(r'"(profagent_[a-z0-9_]+)"', module.read_text()))
    assert len(families) > 60
    text = METRICS.read_text()
    missing = sorted(f for f in families if f not in text)  # a prefix: the unit and `_total` follow
    assert not missing, f"docs/metrics.md does not document: {missing}"


# ---- paths and modules ------------------------------------------------------------------

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s#]+)")
_SPLIT = re.compile(r"[\s\"'=(),:;<>|{}\[\]]+")
_PATHLIKE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./-]*$")
_MODULE = re.compile(r"\bpython3? -m ([A-Za-z_][\w.]*)")
# Top-level folders of the repository: a path starting with one is a repository path.
TOP = ("src", "tests", "deploy", "bench", "docs", "tools", "examples", "dashboards", "systemd")
# Extensions that make a relative token a file path rather than prose ("rank/job", "I/O").
FILE_EXT = (".py", ".md", ".yml", ".yaml", ".json", ".toml", ".txt", ".service", ".sh")
# Shorter paths in the docs are relative to one of these (package modules, test folders,
# the Kubernetes and Prometheus examples, the dashboard generator).
BASES = (
    ROOT, PACKAGE, *(p for p in PACKAGE.iterdir() if p.is_dir()), ROOT / "tools" / "profagent_dashboards",
    ROOT / "tests", ROOT / "tests" / "unit", ROOT / "deploy" / "kubernetes", ROOT / "deploy" / "prometheus",
    ROOT / "dashboards",
)


def _frame_patterns() -> str:
    """The stack classification rules name files of torch and the standard library
    (``torch/_tensor.py``, ``multiprocessing/queues.py``): docs/stacks.md quotes them."""
    return (PACKAGE / "analysis" / "stacks.py").read_text()


def _is_placeholder(token: str) -> bool:
    """``DIR/provisioning``, ``/proc/PID/io``, ``$XDG_STATE_HOME``, ``targets/*.yml``, URLs."""
    return bool(re.search(r"[*$?~]|//|\.\.|\b[A-Z][A-Z0-9_]+\b", token))


def path_tokens(text: str) -> set[str]:
    """Relative paths named in inline code, code blocks and link targets of a markdown text.

    A token is a path when it starts with a repository folder (``deploy/kubernetes``), or
    has a slash and ends in a file extension or a slash (``engine/node.py``, ``golden/``).
    Absolute paths (the user's machine), placeholders and bare file names are not checked.
    """
    spans = _CODE.findall(_FENCE.sub("", text)) + _FENCE.findall(text)
    tokens = {t for span in spans for t in _SPLIT.split(span)}
    tokens |= {t for t in _LINK.findall(text) if "://" not in t and not t.startswith("mailto:")}
    out = set()
    for token in tokens:
        token = token.rstrip(".")  # end of a sentence inside a code block
        if not _PATHLIKE.match(token) or _is_placeholder(token) or "/" not in token:
            continue
        if token.split("/")[0] in TOP or token.endswith("/") or token.endswith(FILE_EXT):
            out.add(token)
    return out


def _exists(token: str, doc: Path) -> bool:
    if token.split("/")[0] in TOP:  # a repository path is from the root, nowhere else
        return (ROOT / token).exists()
    return any((base / token).exists() for base in (doc.parent, *BASES))


def missing_paths(doc: Path) -> list[str]:
    frames = _frame_patterns()
    return sorted(
        t for t in path_tokens(doc.read_text())
        if not _exists(t, doc)
        and not (t.split("/")[0] == "torch" or t in frames or f"torch/{t.split('/')[0]}/" in frames)
    )


def _module_exists(name: str) -> bool:
    relative = Path(*name.split("."))
    for base in (ROOT / "src", ROOT / "tools"):
        if (base / relative).with_suffix(".py").is_file() or (base / relative / "__init__.py").is_file():
            return True
    if name.split(".")[0] in ("profagent", "profagent_dashboards"):
        return False  # ours: only what is in this checkout counts
    return importlib.util.find_spec(name) is not None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_named_in_the_docs_exists(doc: Path) -> None:
    missing = missing_paths(doc)
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_python_dash_m_module_named_in_the_docs_exists(doc: Path) -> None:
    missing = sorted(m for m in set(_MODULE.findall(doc.read_text())) if not _module_exists(m))
    assert not missing, f"{doc.relative_to(ROOT)} names modules that do not exist: {missing}"


def test_the_path_check_sees_the_paths_and_not_the_prose() -> None:
    text = (
        "See `src/profagent/engine/agent.py`, `engine/nope.py`, [x](docs/gone.md), `tests/unit/golden/`,\n"
        "```sh\nprofagent attach --config deploy/none.toml\n```\n"
        "`rank/job`, `I/O`, `nodes/proxy`, `/proc/PID/io`, `DIR/provisioning`, `targets/*.yml`, `c.toml`"
    )
    assert path_tokens(text) == {
        "src/profagent/engine/agent.py", "engine/nope.py", "docs/gone.md", "tests/unit/golden/", "deploy/none.toml",
    }
    doc = ROOT / "docs" / "planted.md"
    assert [t for t in sorted(path_tokens(text)) if not _exists(t, doc)] == [
        "deploy/none.toml", "docs/gone.md", "engine/nope.py",
    ]
    assert _MODULE.findall("run `python -m profagent_dashboards.generate` or python3 -m pytest") == [
        "profagent_dashboards.generate", "pytest",
    ]
    assert _module_exists("profagent_dashboards.generate") and _module_exists("pytest")
    assert not _module_exists("profagent.exporters.grafana.generate")


# ---- metric tables against the golden exposition ---------------------------------------

_ROW = re.compile(r"^\|(.+)\|\s*$")
_NAME = re.compile(r"`(profagent_[a-z0-9_]+)`")


def metric_tables(text: str) -> dict[str, frozenset[str]]:
    """family -> labels, from the metric tables of docs/metrics.md.

    A table has a ``family`` column and a ``labels`` or ``extra labels`` column; labels
    are the backticked names, with their values in parentheses dropped. An ``extra
    labels`` table adds them to the labels its section's first sentence names
    ("Per `job_id`, `rank` and `role`"); ``(none)`` means no label at all.
    """
    section = text
    out: dict[str, frozenset[str]] = {}
    common: frozenset[str] = frozenset()
    header: list[str] = []
    for line in section.splitlines():
        if line.startswith("Per `"):
            common = frozenset(re.findall(r"`([a-z_]+)`", line.split(" (", 1)[0]))
        match = _ROW.match(line)
        if not match:
            header = []
            continue
        cells = [c.strip() for c in match.group(1).split("|")]
        if not header:
            header = cells
            continue
        if set(cells[0]) <= set("-: ") or "family" not in header:
            continue
        labels_col = "labels" if "labels" in header else "extra labels"
        cell = cells[header.index(labels_col)]
        while re.search(r"\([^()]*\)", cell):  # values in parentheses, nested too
            cell = re.sub(r"\([^()]*\)", "", cell)
        labels = frozenset(re.findall(r"`([a-z_][a-z0-9_]*)`", cell))
        if labels_col == "extra labels" and "(none)" not in cells[header.index(labels_col)]:
            labels |= common
        for family in _NAME.findall(cells[header.index("family")]):
            out[family] = labels
    return out


def golden_families(text: str) -> dict[str, frozenset[str]]:
    """family -> labels over every sample of the golden text exposition."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    out: dict[str, set[str]] = {}
    for name, labels in re.findall(r"^(profagent_[a-z0-9_]+)(?:\{(.*?)\})? \S+$", text, re.M):
        if name.endswith("_created") and name.removesuffix("_created") in types:
            continue  # a counter's creation time, not a family of its own
        found = set(re.findall(r'(?:^|,)([a-z_][a-z0-9_]*)="', labels))
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        if types.get(base) == "histogram":  # one family of three series; `le` is the histogram's own
            name, found = base, found - {"le"}
        assert name in types or name.removesuffix("_total") in types, name
        out.setdefault(name, set()).update(found)
    return {f: frozenset(v) for f, v in out.items()}


def test_the_metric_tables_match_the_golden_exposition() -> None:
    tables = metric_tables(METRICS.read_text())
    golden = golden_families(GOLDEN.read_text())
    assert len(golden) > 90  # the golden state covers every family
    assert sorted(set(golden) - set(tables)) == [], "families in the golden exposition, not in docs/metrics.md"
    assert sorted(set(tables) - set(golden)) == [], "families in docs/metrics.md, not in the golden exposition"
    wrong = {f: {"docs": sorted(tables[f]), "golden": sorted(golden[f])} for f in golden if tables[f] != golden[f]}
    assert not wrong, f"labels differ between docs/metrics.md and the golden exposition: {wrong}"


def test_the_table_reader_sees_families_and_labels_and_drops_values() -> None:
    text = (
        "Per `job_id`, `rank` and `role` (`main` for a rank).\n\n"
        "| family | type | extra labels | meaning |\n| --- | --- | --- | --- |\n"
        "| `profagent_a_total` | counter | `mode` (`user`, `system`) | x (`rank` = y) |\n"
        "| `profagent_b`, `profagent_c` | gauge | (none) | y |\n\n"
        "| family | type | labels | unit | meaning |\n| --- | --- | --- | --- | --- |\n"
        "| `profagent_d` | gauge | `gpu`, `dir` (`tx` = from the (GPU), `rx`) | - | z |\n"
        "| `profagent_e` | gauge | | - | z |\n\n## Notes\n| `profagent_f` | gauge |\n"
    )
    assert metric_tables(text) == {
        "profagent_a_total": {"job_id", "rank", "role", "mode"}, "profagent_b": set(), "profagent_c": set(),
        "profagent_d": {"gpu", "dir"}, "profagent_e": set(),
    }
    golden = (
        "# TYPE profagent_a counter\nprofagent_a_total{mode=\"user\",rank=\"0\"} 1.0\n"
        "# TYPE profagent_e gauge\nprofagent_e 2.0\n"
    )
    assert golden_families(golden) == {"profagent_a_total": {"mode", "rank"}, "profagent_e": set()}


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(sorted(path_tokens(Path(arg).read_text())))

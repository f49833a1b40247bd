"""Every repository path that a comment or docstring of the code names exists, and no
comment cites a test run by its number: neither means anything to the next reader.

The paths are found as in the docs (tests/unit/test_docs.py): a token that starts with a
repository folder (``docs/stacks.md``), or has a slash and ends in a file extension
(``engine/node.py``). Shorter paths are looked for beside the file, under the package and
its rooms, and under the repository's folders. Paths of other projects (torch's, the
standard library's) are named by the stack rules and are not ours to check.

Run as a script to see what it extracts (``python tests/unit/test_comment_paths.py``).
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

from helpers.paths import ROOT

PACKAGE = ROOT / "src" / "profagent"
CODE_DIRS = (ROOT / "src", ROOT / "tests", ROOT / "tools", ROOT / "bench", ROOT / "examples")
TOP = ("src", "tests", "deploy", "bench", "docs", "tools", "examples", "dashboards", "systemd")
FILE_EXT = (".py", ".md", ".yml", ".yaml", ".json", ".toml", ".txt", ".service", ".sh")
BASES = (
    ROOT, PACKAGE, *(p for p in PACKAGE.iterdir() if p.is_dir()), ROOT / "tools", ROOT / "tools" / "profagent_dashboards",
    ROOT / "tests", ROOT / "tests" / "unit", ROOT / "tests" / "e2e", ROOT / "deploy" / "kubernetes",
    ROOT / "deploy" / "prometheus", ROOT / "dashboards",
)
# the folders of other projects that comments quote in frame patterns and file layouts
FOREIGN = ("torch", "site-packages", "dist-packages", "multiprocessing", "concurrent", "asyncio", "importlib",
           "json", "logging", "email", "http", "urllib", "ctypes", "lib", "usr", "proc", "sys", "dev", "run", "etc",
           "var", "tmp", "home", "root", "opt", "bin", "sbin", "kineto", "libkineto", "c10", "aten", "hta", "py-spy",
           "nvidia", "cuda", "grafana", "prometheus", "node_modules", "__pycache__", "build", "dist",
           "transformers", "accelerate", "pytorch_lightning", "lightning", "lightning_fabric", "deepspeed")
_SPLIT = re.compile(r"[\s\"'`=(),:;<>|{}\[\]!]+")
_PATHLIKE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./-]*$")
_PLACEHOLDER = re.compile(r"[*$?~]|//|\.\.|\b[A-Z][A-Z0-9_]+\b|<|>")
# "run" and a test run's number; not a flag (--runs N), a range (runs N-M) or a count
# (runs N times)
_TEST_RUN = re.compile(r"(?<![-\w])runs? \d+\b(?![-\d])(?! (?:s|ms|µs|seconds|times|ranks|steps|processes|samples|jobs|pairs)\b)")


def code_files() -> list[Path]:
    return sorted(p for d in CODE_DIRS if d.is_dir() for p in d.rglob("*.py")
                  if ".venv" not in p.parts and "golden" not in p.parts and "fixtures" not in p.parts)


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment (a block of comments on consecutive lines as one text,
    so a phrase broken over two lines is seen whole) and every module, class and function
    docstring."""
    out: list[tuple[int, str]] = []
    last = -2
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type != tokenize.COMMENT:
                continue
            text = tok.string.lstrip("#").strip()
            if tok.start[0] == last + 1 and out:
                out[-1] = (out[-1][0], f"{out[-1][1]} {text}")
            else:
                out.append((tok.start[0], text))
            last = tok.start[0]
    except (tokenize.TokenError, SyntaxError):
        pass
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                out.append((node.body[0].lineno, doc))
    return out


def path_tokens(text: str) -> set[str]:
    out = set()
    for token in _SPLIT.split(text):
        token = token.rstrip(".")
        if not _PATHLIKE.match(token) or _PLACEHOLDER.search(token) or "/" not in token:
            continue
        if token.split("/")[0] in FOREIGN:
            continue
        if token.split("/")[0] in TOP or token.endswith(FILE_EXT):
            out.add(token)
    return out


def _exists(token: str, where: Path) -> bool:
    if token.split("/")[0] in TOP and (ROOT / token).exists():
        return True
    return any((base / token).exists() for base in (where.parent, *BASES))


def problems(path: Path) -> list[str]:
    """``file:line: what`` for each missing path and each cited test run in ``path``."""
    out = []
    for line, text in comments_and_docstrings(path.read_text()):
        for token in sorted(path_tokens(text)):
            if not _exists(token, path):
                out.append(f"{path.relative_to(ROOT)}:{line}: names {token}, which does not exist")
        for cited in _TEST_RUN.findall(text):
            out.append(f"{path.relative_to(ROOT)}:{line}: cites a test run ({cited!r})")
    return out


def test_every_path_named_in_a_comment_exists_and_no_comment_cites_a_run() -> None:
    found = [p for f in code_files() for p in problems(f)]
    assert not found, "\n".join(found)


def test_the_check_sees_missing_paths_and_runs_and_not_the_prose() -> None:
    planted = PACKAGE / "engine" / "planted_example.py"  # never written: only its folder matters
    source = ('"""Reads agent/sampler.py and sources/stacks/pyspy.py; see docs/stacks.md and docs/gone.md."""\n'
              "# torch/_tensor.py and multiprocessing/queues.py are torch's and the stdlib's; rank/job, I/O\n"
              "x = 1  # measured in run 162; 3 runs 10 s apart; /proc/PID/stat; DIR/incidents.json; as in (run\n"
              "# 113) and runs 100-400 of a kernel; bench/startup.py --runs 10\n")
    texts = [t for _, t in comments_and_docstrings(source)]
    tokens = set().union(*(path_tokens(t) for t in texts))
    assert tokens == {"agent/sampler.py", "sources/stacks/pyspy.py", "docs/stacks.md", "docs/gone.md", "bench/startup.py"}
    assert sorted(t for t in tokens if not _exists(t, planted)) == ["agent/sampler.py", "docs/gone.md"]
    assert [c for t in texts for c in _TEST_RUN.findall(t)] == ["run 162", "run 113"]


if __name__ == "__main__":
    for file in (Path(a).resolve() for a in sys.argv[1:]) if sys.argv[1:] else code_files():
        print(*problems(file), sep="\n") if problems(file) else None

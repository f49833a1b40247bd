"""What a newcomer reads holds: the README stays short, every link in the docs resolves
(files and anchors), every command and flag the README names exists in the CLI, every
metric name in the docs is one the code exports, each closed list of label values in
docs/metrics.md is the code's, and the capabilities the docs state are the units' and the
DaemonSet's. Each check derives its truth from the code, so new commands, families and
values fit without editing this file.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import typer.main

from helpers.paths import ROOT
from profagent.cli import app

README = ROOT / "README.md"
DOCS = (README, *sorted((ROOT / "docs").glob("*.md")))
METRICS = ROOT / "docs" / "metrics.md"
PACKAGE = ROOT / "src" / "profagent"
FAMILIES = PACKAGE / "exporters" / "families"

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def test_the_readme_is_at_most_15_kb() -> None:
    size = len(README.read_bytes())
    assert size <= 15 * 1024, f"README.md is {size} bytes: move detail into docs/ and link to it"


# ---- links ---------------------------------------------------------------------------

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """Every heading's anchor in a markdown file, GitHub's ``-1`` suffixes for repeats."""
    out: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", _FENCE.sub("", doc.read_text()), re.M):
        base, n = slug(heading), 0
        name = base
        while name in out:
            n += 1
            name = f"{base}-{n}"
        out.add(name)
    return out


def broken_links(doc: Path) -> list[str]:
    bad = []
    for target in _LINK.findall(_FENCE.sub("", doc.read_text())):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            bad.append(target)
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_link_resolves(doc: Path) -> None:
    bad = broken_links(doc)
    assert not bad, f"{doc.relative_to(ROOT)} links to what does not exist: {bad}"


def test_the_link_check_sees_missing_files_and_anchors(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Why each `capability`\n\n## A, b (c)\n\n## A, b (c)\n")
    doc = tmp_path / "doc.md"
    doc.write_text("# Top\n[a](other.md#why-each-capability) [b](other.md#a-b-c-1) [c](other.md#nope)\n"
                   "[d](gone.md) [e](#top) [f](#bottom) [g](https://x.org/y#z)\n```\n[h](in-a-block.md)\n```\n")
    assert broken_links(doc) == ["other.md#nope", "gone.md", "#bottom"]


# ---- commands and flags --------------------------------------------------------------


def cli_commands() -> dict[tuple[str, ...], set[str]]:
    """Every command path of the CLI (``("incidents", "list")``) -> its long flags."""
    out: dict[tuple[str, ...], set[str]] = {}

    def walk(command: object, path: tuple[str, ...]) -> None:
        flags = {o for p in getattr(command, "params", []) for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}
        out[path] = flags | {"--help"}
        for name, sub in (getattr(command, "commands", None) or {}).items():
            walk(sub, (*path, name))

    walk(typer.main.get_command(app), ())
    return out


_CODE = re.compile(r"`([^`\n]+)`")


def named_commands(text: str) -> list[tuple[tuple[str, ...], list[str]]]:
    """(words after ``profagent``, the long flags given to it) for every command named in
    inline code or a code block; a span of flags alone (``/ `--url URL` ``) belongs to the
    command named before it on its line, and a span with neither to no command (``[]``)."""
    found = []
    lines = [(line, True) for block in _FENCE.findall(text) for line in block.splitlines()[1:-1]]
    lines += [(line, False) for line in _FENCE.sub("", text).splitlines()]
    for line, in_block in lines:
        spans = [line.split("#", 1)[0]] if in_block else _CODE.findall(line)
        current: tuple[str, ...] | None = None
        for span in spans:
            span = re.sub(r"\$\([^)]*\)", "N", span)  # $(pgrep -f ...): another program's flags
            words = span.split()
            if "profagent" in words:
                rest = words[words.index("profagent") + 1:]
                current = tuple(w for w in rest[: next((i for i, w in enumerate(rest) if not re.match(r"^[a-z][a-z-]*$", w)), len(rest))])
                found.append((current, [w.split("=")[0] for w in rest if w.startswith("--")]))
            elif words and words[0].startswith("--") and not in_block:
                found.append((current or (), [w.split("=")[0] for w in words if w.startswith("--")]))
    return found


def unknown_commands_and_flags(text: str) -> list[str]:
    cli = cli_commands()
    every_flag = set().union(*cli.values())
    bad = []
    for words, flags in named_commands(text):
        path = next((words[:n] for n in range(len(words), 0, -1) if words[:n] in cli), ())
        if words and not path:
            bad.append(f"profagent {' '.join(words)}")
            continue
        if words and len(words) > len(path) and words[len(path)] and cli.get((*path, words[len(path)])) is None \
                and any(p[: len(path)] == path and len(p) > len(path) for p in cli):
            bad.append(f"profagent {' '.join(words)}")  # a group's unknown subcommand
        known = cli[path] if path else every_flag
        bad += [f"profagent {' '.join(path)} {flag}".replace("  ", " ") for flag in flags if flag not in known]
    return sorted(set(bad))


def test_every_command_and_flag_the_readme_names_exists() -> None:
    assert not unknown_commands_and_flags(README.read_text())


def test_the_command_check_sees_commands_flags_and_their_owner() -> None:
    text = (
        "| `profagent top --pid N` / `--url URL` | `profagent incidents list` / `show ID` |\n"
        "| `profagent config --defaults` / `--reference` | `profagent nosuch --pid 1` | `--listen` |\n"
        "```sh\nsudo profagent attach --pid $(pgrep -f torchrun) --trace-dir ./t   # --not-a-flag\n"
        "profagent dashboards push --url U --bogus\nprofagent incidents nope\n```\n"
    )
    assert unknown_commands_and_flags(text) == [
        "profagent dashboards push --bogus", "profagent incidents nope", "profagent nosuch",
    ]


# ---- metric names and label values ---------------------------------------------------


def code_families() -> set[str]:
    """The metric names the code exports: every name in the golden exposition (written from
    the exporters by test_exposition_golden.py, one state that fills every family) and every
    name literal in the exporters. Also what is named like a metric and is not one: the
    Prometheus rule groups and the dashboard generator's package."""
    golden = (ROOT / "tests" / "unit" / "golden" / "exposition.txt").read_text()
    names = set(re.findall(r"^(?:# TYPE )?(profagent_[a-z0-9_]+)", golden, re.M))
    for module in FAMILIES.glob("*.py"):
        names |= set(re.findall(r"\"(profagent_[a-z0-9_]+)\"", module.read_text()))
    for rules in (ROOT / "deploy" / "prometheus").glob("*.yml"):
        names |= set(re.findall(r"^\s*- name: (profagent_[a-z0-9_]+)", rules.read_text(), re.M))
    names |= {p.name for p in (ROOT / "tools").iterdir() if p.name.startswith("profagent_")}
    return names


_METRIC = re.compile(r"(?<![\w:])(profagent_[a-z0-9_]*[a-z0-9])(?![\w:*])")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_metric_name_in_the_docs_is_exported(doc: Path) -> None:
    known = code_families()
    named = set(_METRIC.findall(doc.read_text()))
    assert not sorted(named - known), f"{doc.relative_to(ROOT)} names metrics no exporter defines: {sorted(named - known)}"


def test_the_code_families_are_found() -> None:
    known = code_families()
    assert {"profagent_collector_up", "profagent_traces_rejected_total", "profagent_step_seconds_bucket"} <= known
    assert len(known) > 90


def documented_values(family: str, label: str) -> set[str]:
    """The values docs/metrics.md lists for ``label`` of ``family``: `label` (`a`, `b`)."""
    row = next(line for line in METRICS.read_text().splitlines() if line.startswith(f"| `{family}` |"))
    match = re.search(rf"`{label}` \(([^)]*)\)", row)
    assert match, f"docs/metrics.md lists no values for {family}'s {label}"
    return set(re.findall(r"`([a-z0-9_]+)`", match.group(1)))


def collectors_in_code() -> set[str]:
    """The `collector` label's values: the ``name`` of every class that has a ``collect``
    method (each source), and the findings engine's ``NAME``."""
    names = set()
    for module in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(f, ast.FunctionDef) and f.name == "collect" for f in node.body):
                for stmt in node.body:
                    if isinstance(stmt, ast.Assign) and [getattr(t, "id", "") for t in stmt.targets] == ["name"] \
                            and isinstance(stmt.value, ast.Constant):
                        names.add(stmt.value.value)
    engine = (PACKAGE / "engine" / "findings.py").read_text()
    names |= set(re.findall(r'^NAME = "([a-z_]+)"', engine, re.M))
    return names


def test_the_collector_values_are_the_codes_sources() -> None:
    code = collectors_in_code()
    assert {"host", "gpu", "stacks", "traces", "findings"} <= code
    assert documented_values("profagent_collector_up", "collector") == code


def trace_reject_reasons_in_code() -> set[str]:
    """Every reason the traces source counts a file under: its watcher's verdicts, the
    reader's TraceError reasons, the attribution's, and the source's own."""
    reasons = set()
    for module in (PACKAGE / "sources" / "traces").glob("*.py"):
        text = module.read_text()
        reasons |= set(re.findall(r'TraceError\([^()]*(?:\([^()]*\)[^()]*)*,\s*"([a-z_]+)"\)', text))
        reasons |= set(re.findall(r'Attribution\(reason="([a-z_]+)"', text))
        reasons |= set(re.findall(r'_final\(path, sig, "(?:invalid|skipped)", "([a-z_]+)"', text))
        reasons |= set(re.findall(r'_count\(verdict, "(?:invalid|skipped)", "([a-z_]+)"', text))
    return reasons


def test_the_trace_reject_reasons_are_the_codes() -> None:
    code = trace_reject_reasons_in_code()
    assert {"cpu_budget", "truncated", "corrupt", "foreign_owner", "no_job_pid"} <= code
    assert documented_values("profagent_traces_rejected_total", "reason") == code


def test_every_label_value_in_the_metric_tables_is_in_the_code() -> None:
    """A value listed in parentheses after a label is a string the code writes."""
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    literals = set(re.findall(r"[\"']([a-z0-9_]+)[\"']", source))
    missing = set()
    for line in METRICS.read_text().splitlines():
        if not line.startswith("| `profagent_"):
            continue
        labels = line.split("|")[3]
        for values in re.findall(r"`[a-z_]+` \(([^)]*)\)", labels):
            missing |= {v for v in re.findall(r"`([a-z0-9_]+)`", values) if v not in literals}
    assert not sorted(missing), f"docs/metrics.md lists label values the code never writes: {sorted(missing)}"


# ---- capabilities ----------------------------------------------------------------------


def test_the_capabilities_the_docs_state_are_the_units_and_the_daemonsets() -> None:
    units = set()
    for unit in (ROOT / "systemd").glob("*.service"):
        line = re.search(r"^CapabilityBoundingSet=(.*)$", unit.read_text(), re.M)
        assert line, unit
        units.add(frozenset(line.group(1).split()))
    assert len(units) == 1, units  # both units grant the same
    granted = set(next(iter(units)))
    daemonset = (ROOT / "deploy" / "kubernetes" / "base" / "daemonset.yaml").read_text()
    added = re.search(r"^\s*add: \[(.*)\]", daemonset, re.M)
    assert added and {"CAP_" + c.strip(' "') for c in added.group(1).split(",")} == granted
    service = (ROOT / "docs" / "service.md").read_text()
    table = set(re.findall(r"^\| `(CAP_[A-Z_]+)` \|", service, re.M))
    assert table == granted, "docs/service.md's table of capabilities"
    said = set(re.findall(r"CAP_[A-Z_]+", README.read_text().split("**As root**", 1)[1].split("\n\n", 1)[0]))
    assert said == granted, "the README's list of what root's agent holds"

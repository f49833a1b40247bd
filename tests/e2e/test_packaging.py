"""The wheel carries the non-Python assets, so an installed profagent finds them."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from helpers.paths import ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    (built,) = out.glob("profagent-*.whl")
    return built


@pytest.mark.slow
def test_wheel_contains_assets_and_entry_point(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    for folder in ("dashboards", "systemd", "deploy"):
        shipped = [n for n in names if n.startswith(f"profagent/assets/{folder}/")]
        on_disk = [p for p in (ROOT / folder).rglob("*") if p.is_file()]
        assert len(shipped) == len(on_disk) > 0, folder
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "profagent = profagent.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_asset_dir_finds_checkout_folders() -> None:
    from profagent.assets import asset_dir

    for name in ("dashboards", "systemd", "deploy"):
        assert asset_dir(name).is_dir()
    with pytest.raises(FileNotFoundError):
        asset_dir("nope")


def runtime_distributions() -> set[str]:
    """profagent's declared dependencies and theirs, without any extra (test, torch, bench)."""
    seen: set[str] = set()
    todo = [r for r in importlib.metadata.requires("profagent") or []]
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name not in seen:
            seen.add(name)
            todo.extend(importlib.metadata.requires(name) or [])
    return seen


def link_distributions(names: set[str], site: Path) -> None:
    """Make ``names`` importable in ``site`` by linking their installed files (no download)."""
    for name in names:
        dist = importlib.metadata.distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or []}:
            source = Path(str(dist.locate_file(top)))
            if top != ".." and source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)


@pytest.mark.slow
def test_a_plain_install_imports_every_module_it_ships(wheel: Path, tmp_path: Path) -> None:
    """The wheel in a fresh venv that holds only the runtime dependencies (linked from this
    environment rather than downloaded): every module it ships imports."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip())
    assert site != Path(sysconfig.get_path("purelib"))
    res = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    deps = runtime_distributions()
    assert "grafana-foundation-sdk" not in deps and "typer" in deps
    link_distributions(deps, site)
    modules = sorted(
        n[:-3].replace("/", ".").removesuffix(".__init__")
        for n in zipfile.ZipFile(wheel).namelist()
        if n.endswith(".py") and n.startswith("profagent/") and n != "profagent/__main__.py"  # runs the CLI
    )
    assert len(modules) > 60
    probe = (
        "import importlib, sys\n"
        "bad = []\n"
        "for m in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as exc:\n"
        "        bad.append(f'{m}: {exc!r}')\n"
        "import profagent\n"
        "print(profagent.__file__)\n"
        "print('\\n'.join(bad))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    res = subprocess.run([python, "-c", probe, *modules], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    where, *failures = res.stdout.splitlines()
    assert where.startswith(str(site))  # the installed copy, not the checkout
    assert [f for f in failures if f] == []

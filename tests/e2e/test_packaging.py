"""The wheel carries the non-Python assets, so an installed profagent finds them."""

from __future__ import annotations

import importlib.metadata
import json
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

from helpers.grafana import FakeGrafana
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
        if n.endswith(".py") and n.startswith("profagent/")
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


# -- a plain `pip install .` into a fresh venv, as a user beside a training job does --------

# What `python -m venv` puts in every venv before anything is installed: their `.pth`
# (setuptools' distutils-precedence.pth, which imports `_distutils_hack` at start-up) is
# the environment's own, not ours. Anything else that runs at start-up is a defect.
VENV_SEED = {"pip", "setuptools"}

PROBE = r"""
import importlib.metadata as md, json, os, pathlib, sys, sysconfig
site = pathlib.Path(sysconfig.get_path("purelib"))
owner = {}
for dist in md.distributions():
    for f in dist.files or ():
        owner[str(pathlib.Path(dist.locate_file(f)).resolve())] = dist.metadata["Name"].lower().replace("_", "-")
startup = sorted(m for m in json.loads(sys.argv[1]) if m.split(".")[0] not in (*sys.stdlib_module_names, "__main__"))
try:
    import urllib3
    real = [urllib3.__version__, md.version("urllib3"), owner.get(str(pathlib.Path(urllib3.__file__).resolve()))]
except ImportError:
    real = None
print(json.dumps({
    "site": str(site),
    "pth": {p.name: owner.get(str(p.resolve())) for p in site.iterdir() if p.name.endswith(".pth")},
    "startup": {m: owner.get(str(pathlib.Path(sys.modules[m].__file__).resolve()))
                if getattr(sys.modules.get(m), "__file__", None) else None for m in startup},
    "urllib3": real,
    "dists": sorted({d.metadata["Name"].lower().replace("_", "-") for d in md.distributions()}),
}))
"""


class Installed:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.python = root / "bin" / "python"
        # the user's environment, less what would point this venv at the checkout
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        self.seeded: set[str] = set()  # distributions the venv came with
        self.alone: dict = {}  # probe() after `pip install .`
        self.with_requests: dict = {}  # and after `pip install requests`

    def run(self, *args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                              env=self.env, cwd=self.root)

    def pip(self, *args: str | Path) -> subprocess.CompletedProcess:
        res = self.run(self.python, "-m", "pip", *args, timeout=600)
        assert res.returncode == 0, res.stdout + res.stderr
        return res

    def probe(self) -> dict:
        """What the venv's interpreter loads at start-up, its .pth files and urllib3."""
        started = self.run(self.python, "-c", "import json, sys; print(json.dumps(sorted(sys.modules)))")
        assert started.returncode == 0, started.stderr
        res = self.run(self.python, "-c", PROBE, started.stdout.strip())
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """One fresh venv for the module: `pip install .` (dependencies as the index gives
    them), its state probed, then `pip install requests` as a training environment has."""
    root = tmp_path_factory.mktemp("pip-install") / "venv"
    venv.EnvBuilder(with_pip=True).create(root)
    env = Installed(root)
    env.seeded = set(env.probe()["dists"])
    assert env.seeded <= VENV_SEED, env.seeded
    env.pip("install", "-q", ROOT)
    env.alone = env.probe()
    env.pip("install", "-q", "requests")
    env.with_requests = env.probe()
    return env


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pip_install_leaves_urllib3_alone(installed: Installed) -> None:
    """Issue 23: grafana-client pulled urllib3-future, which replaced urllib3 under requests."""
    tree = set(installed.alone["dists"]) - installed.seeded
    assert {"profagent", "typer", "psutil", "py-spy"} <= tree
    assert not tree & {"urllib3-future", "niquests", "grafana-client", "urllib3"}, sorted(tree)
    assert installed.alone["urllib3"] is None  # no urllib3 of any kind until the user asks for one
    version, metadata_version, owner = installed.with_requests["urllib3"]
    assert version == metadata_version and owner == "urllib3"  # the module on disk is the real urllib3's
    res = installed.run(installed.python, "-c", "import requests, urllib3; print(requests.__version__)")
    assert res.returncode == 0, res.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_nothing_from_the_dependency_tree_runs_at_start_up(installed: Installed) -> None:
    """No `.pth` file and no module loaded at interpreter start-up comes from profagent's
    tree (or requests'): only the venv's own (VENV_SEED) may, e.g. setuptools'
    distutils-precedence.pth. A `.pth` that no distribution owns fails too."""
    for probe in (installed.alone, installed.with_requests):
        assert probe["pth"] and set(probe["pth"].values()) <= VENV_SEED, probe["pth"]
        assert set(probe["startup"].values()) <= VENV_SEED, probe["startup"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pip_check_is_clean(installed: Installed) -> None:
    res = installed.pip("check")
    assert "No broken requirements" in res.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dashboards_push_from_the_installed_venv(installed: Installed) -> None:
    grafana = FakeGrafana()
    try:
        res = installed.run(installed.root / "bin" / "profagent", "dashboards", "push", "--url", grafana.url,
                            "--token", "s3cret")
    finally:
        grafana.stop()
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(grafana.dashboards) == len(res.stdout.splitlines()) == 6
    assert all(r[2]["Authorization"] == "Bearer s3cret" for r in grafana.requests)

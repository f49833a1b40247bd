"""The wheel carries the non-Python assets, so an installed profagent finds them."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_contains_assets_and_entry_point(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    (wheel,) = tmp_path.glob("profagent-*.whl")
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

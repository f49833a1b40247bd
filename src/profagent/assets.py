"""Locate the non-Python assets (dashboards, systemd units, deploy examples).

In a wheel they live in ``profagent/assets/``; in a source checkout (editable install)
they are the top-level folders of the repository.
"""

from __future__ import annotations

from pathlib import Path


def asset_dir(name: str) -> Path:
    """Return the folder for asset ``name`` (``dashboards``, ``systemd`` or ``deploy``).

    Raises FileNotFoundError when neither location has it.
    """
    packaged = Path(__file__).resolve().parent / "assets" / name
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parents[2] / name
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"profagent asset folder {name!r} not found")

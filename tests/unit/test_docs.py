"""The README documents every metric family the exporters can emit."""

from __future__ import annotations

import re

from helpers.paths import ROOT


def test_every_family_is_in_the_readme() -> None:
    families = set()
    for module in (ROOT / "src" / "profagent" / "exporters" / "families").glob("*.py"):
        families |= set(re.findall(r'"(profagent_[a-z0-9_]+)"', module.read_text()))
    assert len(families) > 60
    readme = (ROOT / "README.md").read_text()
    missing = sorted(f for f in families if f not in readme)
    assert not missing, f"README.md does not document: {missing}"

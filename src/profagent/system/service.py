"""``profagent install-service``: put the systemd units and a default config in place.

The units in ``systemd/`` name ``/usr/local/bin/profagent``; the installed copies name
the profagent actually installed (a venv's, pipx's...), since systemd needs an absolute
path. An existing config file is never overwritten.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from profagent.assets import asset_dir
from profagent.config import default_toml
from profagent.errors import UserError

UNITS = ("profagent.service", "profagent-attach@.service")
PLACEHOLDER = "/usr/local/bin/profagent"
UNIT_DIR = Path("etc/systemd/system")
CONFIG_FILE = Path("etc/profagent/config.toml")


@dataclass(frozen=True)
class Installed:
    units: tuple[Path, ...]
    config: Path
    config_written: bool
    executable: str


def find_executable() -> str:
    """The absolute path of the installed ``profagent`` script. Raises UserError if none."""
    beside = Path(sys.executable).parent / "profagent"
    if beside.is_file():
        return str(beside.absolute())
    found = shutil.which("profagent")
    if found:
        return str(Path(found).absolute())
    raise UserError(
        "no installed `profagent` command found next to this Python or on PATH",
        "install profagent (pip install profagent) or pass --executable PATH",
    )


def render_unit(text: str, executable: str) -> str:
    """The unit with ExecStart pointing at ``executable``."""
    if " " in executable:
        raise UserError(f"executable path {executable!r} contains a space", "install profagent under a path without spaces")
    return text.replace(PLACEHOLDER, executable)


def install(prefix: str | Path = "/", executable: str | None = None) -> Installed:
    """Write the units under PREFIX/etc/systemd/system and the default config under
    PREFIX/etc/profagent (kept if it exists). Raises UserError on a failed write."""
    prefix = Path(prefix)
    exe = executable or find_executable()
    if not Path(exe).is_absolute():
        raise UserError(f"executable {exe!r} is not an absolute path", "pass an absolute --executable")
    render_unit("", exe)  # refuses a path systemd would split, before anything is written
    source = asset_dir("systemd")
    written = []
    try:
        unit_dir = prefix / UNIT_DIR
        unit_dir.mkdir(parents=True, exist_ok=True)
        for name in UNITS:
            dest = unit_dir / name
            dest.write_text(render_unit((source / name).read_text(), exe))
            dest.chmod(0o644)
            written.append(dest)
        config = prefix / CONFIG_FILE
        config.parent.mkdir(parents=True, exist_ok=True)
        fresh = not config.exists()
        if fresh:
            config.write_text(default_toml())
            config.chmod(0o644)
    except PermissionError as exc:
        raise UserError(f"not permitted to write {exc.filename}", "run as root, or use --prefix DIR") from None
    except OSError as exc:
        raise UserError(f"cannot write {exc.filename} ({exc.strerror})", "check --prefix") from None
    return Installed(tuple(written), config, fresh, exe)

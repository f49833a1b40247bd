"""The systemd units: `systemd-analyze verify` clean, security exposure <= 4.0, install-service.

`systemd-analyze verify` checks that ExecStart's binary exists, so the units are checked
as install-service writes them (ExecStart = this checkout's profagent).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from profagent.assets import asset_dir
from profagent.config import default_toml
from profagent.errors import UserError
from profagent.system.service import UNITS, find_executable, install

MAX_EXPOSURE = 4.0
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def _analyze(*args: str) -> subprocess.CompletedProcess:
    assert ANALYZE is not None
    return subprocess.run([ANALYZE, *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    prefix = tmp_path_factory.mktemp("root")
    install(prefix)
    return prefix / "etc/systemd/system"


def _unit(name: str) -> str:
    return (asset_dir("systemd") / name).read_text()


def _directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


@needs_analyze
@pytest.mark.parametrize("unit", UNITS)
def test_verify_is_clean(installed: Path, unit: str) -> None:
    res = _analyze("verify", str(installed / unit))
    assert res.returncode == 0, res.stderr
    assert (res.stdout + res.stderr).strip() == ""


@needs_analyze
@pytest.mark.parametrize("unit", UNITS)
def test_security_exposure_at_most_4(installed: Path, unit: str) -> None:
    res = _analyze("security", "--offline=yes", "--no-pager", str(installed / unit))
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", res.stdout)
    assert match, res.stdout + res.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE, res.stdout


@needs_analyze
def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check above can fail: a typo'd directive is reported."""
    bad = tmp_path / "profagent.service"
    bad.write_text(_unit("profagent.service").replace("ProtectSystem=strict", "ProtectSystm=strict")
                   .replace("/usr/local/bin/profagent", find_executable()))
    res = _analyze("verify", str(bad))
    assert "ProtectSystm" in res.stdout + res.stderr


def test_watch_unit_runs_watch_mode_as_a_notify_service() -> None:
    d = _directives(_unit("profagent.service"))
    assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"]
    assert d["ExecStart"] == ["/usr/local/bin/profagent watch --config /etc/profagent/config.toml"]
    assert d["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert float(d["WatchdogSec"][0]) > 0
    assert d["Restart"] == ["on-failure"] and d["RestartPreventExitStatus"] == ["2"]
    assert d["StateDirectory"] == ["profagent"] and d["StandardError"] == ["journal"]


@pytest.mark.parametrize("unit", UNITS)
def test_hardening(unit: str) -> None:
    text = _unit(unit)
    d = _directives(text)
    assert d["CapabilityBoundingSet"] == ["CAP_SYS_PTRACE CAP_DAC_READ_SEARCH CAP_PERFMON CAP_CHECKPOINT_RESTORE"]
    assert d["NoNewPrivileges"] == ["yes"]
    assert d["ProtectSystem"] == ["strict"] and d["ReadWritePaths"] == ["/tmp", "-/sys/kernel/tracing"]
    assert d["ProtectHome"] == ["read-only"]
    assert d["RestrictAddressFamilies"] == ["AF_UNIX AF_INET AF_INET6"]
    assert d.get("PrivateTmp", ["no"]) == ["no"]
    assert "No PrivateTmp" in text  # the reason is written next to it


def test_attach_template_takes_the_pid_as_instance() -> None:
    d = _directives(_unit("profagent-attach@.service"))
    assert d["ExecStart"] == ["/usr/local/bin/profagent attach --pid %i --config /etc/profagent/config.toml"]
    assert d["Type"] == ["exec"]


def test_install_service_writes_units_and_keeps_an_existing_config(tmp_path: Path) -> None:
    exe = find_executable()
    done = install(tmp_path)
    assert done.config_written and done.executable == exe
    for unit in UNITS:
        text = (tmp_path / "etc/systemd/system" / unit).read_text()
        assert f"ExecStart={exe} " in text and "/usr/local/bin/profagent" not in text
    config = tmp_path / "etc/profagent/config.toml"
    assert config.read_text() == default_toml()
    config.write_text("listen = ':19500'\n")
    again = install(tmp_path)
    assert not again.config_written
    assert config.read_text() == "listen = ':19500'\n"


def test_install_service_command(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "profagent", "install-service", "--prefix", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "profagent.service" in res.stdout and "written" in res.stdout
    assert (tmp_path / "etc/systemd/system/profagent-attach@.service").is_file()
    res = subprocess.run([sys.executable, "-m", "profagent", "install-service", "--prefix", str(tmp_path),
                          "--executable", "relative/profagent"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert len([line for line in res.stderr.splitlines() if line.strip()]) == 1


def test_install_service_refuses_a_path_with_spaces_before_writing(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="contains a space"):
        install(tmp_path, "/opt/my tools/profagent")
    assert not any(tmp_path.iterdir())


def _bytes(value: str) -> int:
    """systemd's size suffixes (base 1024), as MemoryMax= reads them."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if value[-1:].upper() in units:
        return int(float(value[:-1]) * units[value[-1].upper()])
    return int(value)


SOAK_RSS_BYTES = 60 << 20  # agent RSS in the soak runs (docs/service.md)


@pytest.mark.parametrize("unit", UNITS)
def test_resource_limits_bound_a_runaway_agent(unit: str) -> None:
    """A flood cannot take the node down: memory, CPU and tasks are capped, with headroom."""
    d = _directives(_unit(unit))
    memory_max, memory_high = _bytes(d["MemoryMax"][0]), _bytes(d["MemoryHigh"][0])
    assert 10 * SOAK_RSS_BYTES <= memory_high < memory_max <= 4 << 30
    quota = d["CPUQuota"][0]
    assert quota.endswith("%") and 20 <= float(quota[:-1]) <= 100
    assert 64 <= int(d["TasksMax"][0]) <= 1024
    assert "Soak figures" in _unit(unit)  # the sizing is justified next to it


@needs_analyze
@pytest.mark.parametrize("unit", UNITS)
def test_systemd_reads_the_limits(installed: Path, unit: str, tmp_path: Path) -> None:
    """systemd parses the values (a typo'd size is reported by verify, so this can fail)."""
    bad = tmp_path / unit
    bad.write_text((installed / unit).read_text().replace("MemoryMax=1G", "MemoryMax=1Gx"))
    res = _analyze("verify", str(bad))
    assert "Invalid memory limit '1Gx'" in res.stdout + res.stderr


def test_attach_unit_has_a_runtime_directory_under_strict() -> None:
    """ProtectSystem=strict makes /run read-only: /run/profagent must be a RuntimeDirectory."""
    d = _directives(_unit("profagent-attach@.service"))
    assert d["ProtectSystem"] == ["strict"]
    assert d["RuntimeDirectory"] == ["profagent"]
    assert "/run/profagent/attach-%i.env" in d["EnvironmentFile"][0]

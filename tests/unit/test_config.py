"""Config precedence (flag > env > file > default), validation and the generated reference."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.paths import ROOT
from profagent.config import (
    all_keys,
    default_toml,
    effective_toml,
    load_config,
    parse_listen,
    reference_markdown,
)
from profagent.errors import UserError


def test_defaults() -> None:
    cfg = load_config()
    assert cfg.agent.listen == ":19400"
    assert cfg.agent.interval == 1.0
    assert cfg.interval_of("host") == 1.0


def test_precedence_flag_over_env_over_file(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('interval = 0.5\nlisten = "127.0.0.1:1"\n[gpu]\nbackend = "off"\n[host]\ninterval = 2.0\n')
    cfg = load_config(f)
    assert (cfg.agent.interval, cfg.gpu.backend, cfg.interval_of("host")) == (0.5, "off", 2.0)
    cfg = load_config(f, {"PROFAGENT_INTERVAL": "0.25", "PROFAGENT_GPU_BACKEND": "simulated"})
    assert (cfg.agent.interval, cfg.gpu.backend) == (0.25, "simulated")
    cfg = load_config(f, {"PROFAGENT_INTERVAL": "0.25"}, {"interval": 0.3, "listen": None})
    assert cfg.agent.interval == 0.3
    assert cfg.agent.listen == "127.0.0.1:1"  # a flag left unset does not override


def test_env_types(tmp_path: Path) -> None:
    cfg = load_config(None, {"PROFAGENT_HOST_ENABLED": "false", "PROFAGENT_TRACES_DIRS": "/a,/b"})
    assert cfg.host.enabled is False
    assert cfg.traces.dirs == ["/a", "/b"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("intervall = 1\n", "unknown config key 'intervall'.*did you mean 'interval'"),
        ("[gpu]\nbackand = 'off'\n", "unknown config key 'gpu.backand'.*did you mean 'gpu.backend'"),
        ("interval = 'fast'\n", "invalid value 'fast' for 'interval'"),
        ("interval = 0.01\n", "below the minimum"),
        ("listen = 'nope'\n", "invalid listen address"),
        ("log_level = 'loud'\n", "invalid log level"),
        ("interval = \n", "malformed config file"),
    ],
)
def test_bad_files_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(UserError, match=message):
        load_config(f)


def test_unknown_env_suggests() -> None:
    with pytest.raises(UserError, match="PROFAGENT_LISTN.*PROFAGENT_LISTEN"):
        load_config(None, {"PROFAGENT_LISTN": ":1"})


def test_missing_file() -> None:
    with pytest.raises(UserError, match="not found"):
        load_config("/nonexistent/profagent.toml")


def test_parse_listen() -> None:
    assert parse_listen(":19400") == ("0.0.0.0", 19400)
    assert parse_listen("127.0.0.1:80") == ("127.0.0.1", 80)
    assert parse_listen("[::1]:9") == ("::1", 9)


def test_default_toml_round_trips(tmp_path: Path) -> None:
    text = default_toml()
    uncommented = re.sub(r"(?m)^# (\w+ = )", r"\1", text)
    f = tmp_path / "all.toml"
    f.write_text(uncommented)
    assert load_config(f) == load_config()


def test_reference_doc_is_current() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert reference_markdown() in doc, "docs/configuration.md is stale: run `profagent config --reference`"
    for key in all_keys():
        assert f"`{key.dotted}`" in doc


def test_effective_toml_loads_back_to_the_same_values(tmp_path: Path) -> None:
    """Issue 23: `profagent config` printed Python reprs (False, 'x') that no TOML reader takes."""
    f = tmp_path / "in.toml"
    f.write_text(r"""listen = "127.0.0.1:9"
cmdline_args = true
[traces]
dirs = ['C:\x "y"', "/\u00fc\n"]
[watch]
cmdline_regex = '^python(\d)?$'
""")
    config = load_config(f, {"PROFAGENT_STACKS_RATE": "7", "PROFAGENT_GPU_BACKEND": "simulated"})
    # not the defaults: quotes, backslashes, a newline and non-ASCII in strings, a list, an int
    assert config.traces.dirs == ['C:\\x "y"', "/\u00fc\n"] and config.watch.cmdline_regex == "^python(\\d)?$"
    assert config.stacks.rate == 7 and config.agent.cmdline_args is True
    text = effective_toml(config)
    assert "True" not in text and "False" not in text
    out = tmp_path / "out.toml"
    out.write_text(text)
    assert load_config(out) == config
    assert effective_toml(load_config(out)) == text


def test_config_command_output_is_a_config_file(tmp_path: Path) -> None:
    """`profagent config > c.toml; profagent config --config c.toml` prints the same file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROFAGENT_")}
    first = subprocess.run([sys.executable, "-m", "profagent", "config"], capture_output=True, text=True,
                           timeout=60, env={**env, "PROFAGENT_TRACES_DIRS": "/a,/b", "PROFAGENT_LOG_LEVEL": "debug"})
    assert first.returncode == 0, first.stderr
    saved = tmp_path / "c.toml"
    saved.write_text(first.stdout)
    second = subprocess.run([sys.executable, "-m", "profagent", "config", "--config", str(saved)],
                            capture_output=True, text=True, timeout=60, env=env)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    assert load_config(saved).agent.log_level == "debug" and load_config(saved).traces.dirs == ["/a", "/b"]

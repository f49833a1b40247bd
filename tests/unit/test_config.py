"""Config precedence (flag > env > file > default), validation and the generated reference."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers.paths import ROOT
from profagent.config import all_keys, default_toml, load_config, parse_listen, reference_markdown
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

"""Output is data (issue 25, items 11 and 14): names from the jobs are escaped before any
terminal or log line, in one place (``labels.printable``) used at each boundary."""

from __future__ import annotations

import io
import logging
import sys

import pytest
from rich.console import Console
from test_top_render import (  # the same fixture rows as top's own tests (rootdir import)
    payload,
    rank,
)

from profagent.cli.diagnose import render as render_diagnosis
from profagent.cli.top import ViewState, read, screen
from profagent.labels import printable, printable_data
from profagent.logs import PrintableFormatter

HOSTILE_RANK = "0\x1b]2;X\x1b\\"
HOSTILE_JOB = "job\nprofagent ERROR: forged[/bold][red]"
HOSTILE_FUNCTION = "\x1b[2Jspin\u202e\x9b (evil.py:1)"


@pytest.mark.parametrize(("text", "shown"), [
    ("plain name (train.py:3)", "plain name (train.py:3)"),
    ("0\x1b]2;X\x1b\\", "0\\x1b]2;X\\x1b\\"),
    ("a\nb\r\tc\x00", "a\\x0ab\\x0d\\x09c\\x00"),
    ("c1\x9b and del\x7f", "c1\\x9b and del\\x7f"),
    ("bidi\u202eand\u2028line", "bidi\\u202eand\\u2028line"),
    ("ünïcödé … ·", "ünïcödé … ·"),  # printable non-ASCII stays
])
def test_printable_escapes_every_control_character(text: str, shown: str) -> None:
    assert printable(text) == shown


def test_printable_data_escapes_keys_and_values_and_keeps_the_rest() -> None:
    assert printable_data({"k\x1b": ["\n", 1, None, {"x": 2.5}], "r": True}) == {"k\\x1b": ["\\x0a", 1, None, {"x": 2.5}], "r": True}
    assert printable("a\nb\x1b", keep_newlines=True) == "a\nb\\x1b"


def _render(renderable) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None, force_terminal=True).print(renderable)
    return out.getvalue()


def test_top_escapes_ranks_job_ids_and_function_names_even_in_the_stack_pane() -> None:
    doc = payload([rank(0, rank=HOSTILE_RANK, top_function=HOSTILE_FUNCTION,
                         functions=[{"function": HOSTILE_FUNCTION, "share": 0.9}])])
    doc["jobs"][0]["job_id"] = HOSTILE_JOB
    folded = f"process 100:\"python\";thread (0x1): \"MainThread\";<module> (x.py:1);{HOSTILE_FUNCTION} 50\n"
    text = _render(screen(read(doc), ViewState(detail=True), folded, interactive=True))
    visible = text.replace("\x1b[", "")  # rich's own styling (force_terminal) starts with ESC [
    assert "\x1b]" not in text and "\x9b" not in text and "\u202e" not in text
    assert "\\x1b[2Jspin" in visible and "0\\x1b]2;X\\x1b\\" in visible
    assert "profagent ERROR: forged" in text and "\nprofagent ERROR" not in text  # on the job's line


def test_diagnose_escapes_control_characters_and_markup() -> None:
    body = {"time": 100.0, "findings": [{
        "finding": "hang[/]", "severity": "critical", "job_id": HOSTILE_JOB, "rank": HOSTILE_RANK, "since": 90.0,
        "summary": f"rank {HOSTILE_RANK} is stuck at {HOSTILE_FUNCTION}",
        "evidence": {"stacks": {HOSTILE_RANK: ["<module> (x.py:1)", HOSTILE_FUNCTION]}},
    }]}
    out = io.StringIO()
    render_diagnosis(body, Console(file=out, width=300, color_system=None, force_terminal=False))
    text = out.getvalue()
    assert "\x1b" not in text and "\x9b" not in text and "\u202e" not in text
    assert "hang[/]" in text and "[/bold][red]" in text  # markup shown as text, not obeyed
    assert "job\\x0aprofagent ERROR: forged" in text and "\nprofagent ERROR" not in text
    assert "\\x1b[2Jspin" in text


def test_a_log_message_stays_one_escaped_line() -> None:
    formatter = PrintableFormatter("profagent %(levelname)s: %(message)s")
    record = logging.LogRecord("profagent.x", logging.INFO, __file__, 1, "attached to job %s (%s)", (HOSTILE_JOB, HOSTILE_FUNCTION), None)
    line = formatter.format(record)
    assert "\n" not in line and "\x1b" not in line and "\x9b" not in line
    assert line == "profagent INFO: attached to job job\\x0aprofagent ERROR: forged[/bold][red] (\\x1b[2Jspin\\u202e\\x9b (evil.py:1))"
    try:
        raise ValueError("bad \x1b[2J path\nsecond")
    except ValueError:
        record = logging.LogRecord("profagent.x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    text = formatter.format(record)
    assert "\x1b" not in text and "Traceback" in text  # the traceback keeps its lines


def test_analyze_shows_hostile_kernel_op_and_rank_names_as_text(tmp_path) -> None:
    import gzip
    import json

    from helpers.paths import shared_traces
    from profagent.cli.analyze import analyze_files

    data = json.loads(gzip.decompress((shared_traces() / "mi250-rocm.pt.trace.json.gz").read_bytes()))
    for e in data["traceEvents"]:
        if e.get("cat") in ("kernel", "cpu_op", "user_annotation", "gpu_user_annotation"):
            e["name"] = "[/]\x1b[2J" + e["name"]
    data["distributedInfo"] = {"rank": "3\x1b]2;X\x07[bold]", "world_size": 4}
    for i in range(2):  # two traces: the cross-rank summary prints the ranks too
        (tmp_path / f"t{i}.pt.trace.json").write_text(json.dumps(data))
    out = io.StringIO()
    analyze_files([tmp_path], False, 10, Console(file=out, width=200, color_system=None, force_terminal=False))
    text = out.getvalue()
    assert "\x1b" not in text and "\x07" not in text
    assert "[/]\\x1b[2J" in text and "3\\x1b]2;X\\x07[bold]" in text  # shown, as text

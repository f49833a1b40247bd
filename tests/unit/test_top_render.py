"""`profagent top`'s rendering: pure functions over the /api/ranks JSON, at 80 columns."""

from __future__ import annotations

import io

from rich.console import Console

from profagent.cli.top import (
    ViewState,
    _first_payload,
    category_bar,
    human_bytes,
    human_seconds,
    main_stack,
    on_key,
    parse_keys,
    screen,
    sort_ranks,
)

LONG = "DistributedDataParallel._sync_buffers_and_run_a_very_long_function_name (torch/nn/parallel/distributed.py)"


def rank(n: int, **kw) -> dict:
    row = {
        "rank": str(n), "local_rank": str(n), "pid": 100 + n, "state": "running", "stalled_seconds": None,
        "categories": {"forward": 0.5, "backward": 0.3, "dataloader": 0.2}, "categories_recent": True,
        "top_function": LONG, "top_function_share": 0.42,
        "functions": [{"function": LONG, "share": 0.42}, {"function": "step (train.py)", "share": 0.2}],
        "cpu_percent": 97.5, "rss_bytes": 3 << 30, "uss_bytes": 2 << 30, "threads": 12, "workers": 4,
        "workers_rss_bytes": 1 << 30, "gpu": {"gpus": [n], "utilization_ratio": 0.93, "memory_bytes": 70 << 30},
        "step": {"mean_seconds": 0.412, "max_seconds": 0.5, "steps": 5, "age_seconds": 3.0},
    }
    row.update(kw)
    return row


def payload(ranks: list[dict], findings: list[dict] | None = None) -> dict:
    return {"node": "gpu-node-17", "time": 0.0, "jobs": [{
        "job_id": "slurm-4242", "alive": True, "root_pid": 99, "world_size": len(ranks),
        "gpu": {"count": 8, "up": 8, "names": ["NVIDIA H100 80GB HBM3"], "simulated": False,
                "utilization_ratio": 0.81, "memory_used_bytes": 500 << 30, "memory_total_bytes": 640 << 30},
        "sources": {"host": True, "stacks": True, "gpu": True, "traces": False},
        "findings": findings or [], "ranks": ranks,
    }]}


def render(doc: dict, view: ViewState | None = None, interactive: bool = False, folded: str | None = None,
           width: int = 80) -> list[str]:
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, force_terminal=False)
    console.print(screen(doc, view or ViewState(), folded, interactive=interactive))
    return [line.rstrip() for line in out.getvalue().splitlines()]


def test_one_row_per_rank_rank_first_within_80_columns() -> None:
    lines = render(payload([rank(0), rank(1, state="stalled", stalled_seconds=95.0, cpu_percent=0.0)]))
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    text = "\n".join(lines)
    assert "job slurm-4242" in text and "world 2" in text and "node gpu-node-17" in text
    assert "8/8 × H100 80GB HBM3" in text and "util 81%" in text and "sources off: traces" in text
    rows = [line.split() for line in lines if line.split() and line.split()[0] in ("0", "1")]
    assert [r[0] for r in rows] == ["0", "1"]
    assert rows[0][1] == "running" and rows[1][1:3] == ["STALLED", "95s"]
    row0 = next(line for line in lines if line.split()[:1] == ["0"])
    assert "3.0G/2.0G" in row0 and "93% 70G" in row0 and "412ms" in row0 and " 98 " in f"{row0} "
    assert "42% Distributed" in row0 and row0.endswith("…")  # long names shrink, not wrap


def test_findings_in_the_header() -> None:
    finding = {"finding": "hang", "job_id": "slurm-4242", "rank": "1", "severity": "critical",
               "summary": "rank 1 stuck in all_reduce for 95 s while the others wait", "evidence": {}, "since": 0.0}
    lines = render(payload([rank(0), rank(1)], [finding]))
    assert any(line.startswith("! hang (rank 1): rank 1 stuck in all_reduce") for line in lines)
    assert "findings: none active" in "\n".join(render(payload([rank(0)])))


def test_a_rank_named_straggler_is_slow_in_the_state_column() -> None:
    """A stalled rank stays STALLED; the straggler, still running, is SLOW; the others run."""
    slow = {"finding": "straggler", "job_id": "slurm-4242", "rank": "2", "severity": "warning",
            "summary": "rank 2 is the straggler: it called 90% of the job's last 200 collectives last",
            "evidence": {"signal": "arrivals"}, "since": 0.0}
    job_wide = {**slow, "finding": "stall", "rank": None}
    lines = render(payload([rank(0), rank(1, state="stalled", stalled_seconds=5.0), rank(2)], [slow, job_wide]))
    states = {line.split()[0]: line.split()[1] for line in lines if line.split()[:1] in (["0"], ["1"], ["2"])}
    assert states == {"0": "running", "1": "STALLED", "2": "SLOW"}, lines
    assert [line.split()[1] for line in render(payload([rank(2)])) if line.split()[:1] == ["2"]] == ["running"]


def test_missing_values_show_as_dashes_not_zero() -> None:
    bare = rank(0, cpu_percent=None, uss_bytes=None, rss_bytes=None, gpu=None, step=None, categories={},
                top_function=None, top_function_share=None)
    row = next(line for line in render(payload([bare])) if line.split()[:1] == ["0"])
    assert row.split() == ["0", "running", "-", "-", "-", "-", "-", "-"]


def test_category_bar_cells_follow_the_shares() -> None:
    bar = category_bar({"forward": 0.5, "backward": 0.3, "dataloader": 0.2}).plain
    assert bar == "fffffbbbdd"
    assert category_bar({"collective": 0.85, "idle": 0.15}).plain == "cccccccccc"[:9] + "i"  # largest remainder
    assert len(category_bar({"forward": 1 / 3, "backward": 1 / 3, "other": 1 / 3}).plain) == 10
    assert category_bar({}).plain.strip() == "-"


def test_sort_keys_put_the_worst_rank_first() -> None:
    ranks = [rank(0, cpu_percent=10.0), rank(1, state="stalled", stalled_seconds=5.0),
             rank(2, cpu_percent=300.0, gpu={"gpus": [2], "utilization_ratio": 0.0, "memory_bytes": 1}),
             rank(10, state="stalled", stalled_seconds=50.0)]
    order = lambda key: [r["rank"] for r in sort_ranks(ranks, key)]  # noqa: E731
    assert order("rank") == ["0", "1", "2", "10"]  # numerically
    assert order("state") == ["10", "1", "0", "2"]
    assert order("cpu")[0] == "2" and order("gpu")[0] == "2"


def test_keys_select_sort_detail_quit() -> None:
    assert parse_keys("\x1b[B\r") == ["down", "enter"]  # two keys in one read
    assert parse_keys("\x1bOAq") == ["up", "q"]
    assert parse_keys("\x1b") == ["esc"] and parse_keys("\x1b[5~s") == ["s"]
    view = ViewState()
    for key in ("down", "down", "down"):
        view = on_key(view, key, rows=2)
    assert view.selected == 1  # stops at the last row
    view = on_key(on_key(view, "enter", 2), "s", 2)
    assert view.detail and view.sort == "state"
    assert on_key(view, "esc", 2).detail is False
    assert on_key(view, "q", 2).quit


def test_detail_shows_top_functions_and_the_current_main_stack() -> None:
    folded = (
        "thread (101): MainThread;<module> (train.py:9);train (train.py:40);all_reduce (torch/distributed/c10d.py:2500) 50\n"
        "thread (101): MainThread;<module> (train.py:9);train (train.py:41);step (train.py:12) 5\n"
        "thread (555): pin_memory;_pin_memory_loop (torch/utils/data/pin.py:10) 90\n"
    )
    frames = main_stack(folded, 101)
    assert frames[-1] == "all_reduce (torch/distributed/c10d.py:2500)" and frames[0] == "<module> (train.py:9)"
    lines = render(payload([rank(0), rank(1, pid=101)]), ViewState(selected=1, detail=True), True, folded)
    text = "\n".join(lines)
    assert all(len(line) <= 80 for line in lines)
    assert "rank 1  pid 101" in text and "20%  step (train.py)" in text
    assert text.index("train (train.py:40)") < text.index("all_reduce (torch/distributed/c10d.py:2500)")
    assert "_pin_memory_loop" not in text  # the main thread only
    assert any(line.lstrip().startswith("›1 ") for line in lines)  # the selected row is marked
    assert "keys:" in text
    assert "(no stacks" in "\n".join(render(payload([rank(0)]), ViewState(detail=True), True, None))


def test_no_job_yet() -> None:
    assert "no job observed yet" in render({"node": "n", "time": 0, "jobs": []})[0]


def test_units() -> None:
    assert [human_bytes(x) for x in (None, 512, 1536, 12 << 20, 3 << 30)] == ["-", "512", "1.5K", "12M", "3.0G"]
    assert [human_seconds(x) for x in (None, 0.0123, 1.5, 42.0, 600.0, 10000.0)] == ["-", "12ms", "1.5s", "42s", "10m", "3h"]


class ScriptedFeed:
    """/api/ranks payloads in order; the last one repeats."""

    def __init__(self, payloads: list[dict]) -> None:
        self.payloads, self.calls = payloads, 0

    def ranks(self) -> dict:
        self.calls += 1
        return self.payloads[min(self.calls, len(self.payloads)) - 1]

    def stacks(self, rank: str, job_id: str, seconds: float) -> None:
        return None

    def close(self) -> None:
        pass


def test_first_payload_waits_at_most_its_budget_then_prints_what_it_has() -> None:
    now = [0.0]
    incomplete = {"jobs": [{"ranks": [rank(0, cpu_percent=None, categories={})]}]}
    feed = ScriptedFeed([incomplete])
    got = _first_payload(feed, 1.0, sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0])
    assert got is incomplete and now[0] <= 1.1 and feed.calls >= 5  # asks often, gives up at the budget


def test_first_payload_returns_as_soon_as_rates_and_categories_arrive() -> None:
    now = [0.0]
    incomplete = {"jobs": [{"ranks": [rank(0, categories={})]}]}
    complete = {"jobs": [{"ranks": [rank(0)]}]}
    feed = ScriptedFeed([incomplete, incomplete, complete])
    got = _first_payload(feed, 1.0, sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0])
    assert got is complete and feed.calls == 3 and now[0] < 0.5


def test_ranks_whose_steps_do_not_begin_at_optimizer_step_say_why_under_the_table() -> None:
    note = "steps from backward passes: no Optimizer.step block arrives (...); set x = True"
    none = "no step boundary: neither an Optimizer.step block nor a backward pass arrives (...)"
    lines = render(payload([rank(0, timeline={"p50_seconds": 0.05, "step_boundary": "backward", "steps_note": note}),
                            rank(1, timeline={"p50_seconds": 0.05, "step_boundary": "backward", "steps_note": note}),
                            rank(2, step=None, timeline={"p50_seconds": None, "step_boundary": "none",
                                                         "steps_note": none}),
                            rank(3, timeline={"p50_seconds": 0.05, "step_boundary": "optimizer"})]), width=200)
    text = "\n".join(lines)
    assert f"step, ranks 0, 1: {note}" in text and f"step, rank 2: {none}" in text
    assert "rank 3" not in text and text.count("step, rank") == 2

"""The framework jobs (tests/workloads/{hf_trainer,lightning,accelerate,compile}_job.py,
issue #50) as one job per test file, watched by one agent through phases: healthy, its
figures against the job's own log at a checkpoint pause, the pause itself, a straggler,
a hang. Each phase is a function here; the test files name the job and call them in order.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from helpers.agent import AgentProcess, free_port, http_get
from helpers.paths import WORKLOADS
from helpers.plain_ddp import rank_events, trigger_event
from helpers.processes import kill_tree, wait_for
from helpers.timeline import STAGES, attach, check_figures, findings, metrics, value
from profagent.config import FindingsConfig, StacksConfig

RANKS = 2
HEALTHY_SECONDS = 35.0  # watched with no finding; go to the pause stays within the p50's 60 s window
NAMED_WITHIN = 60.0  # a straggler, from its first slow step
HELD_SECONDS = 20.0
LINE_WITHIN = 35.0  # a hang's warning with the user's line, from the rank's last step


class FrameworkJob:
    """One framework job of two ranks: under torchrun, or started as its docs say
    (``launcher="self"``: Lightning's own launcher starts rank 1)."""

    def __init__(self, tmp: Path, script: str, launcher: str = "torchrun", env: dict[str, str] | None = None) -> None:
        self.dir = tmp
        self.start_file = tmp / "go"
        self.trigger = tmp / "trigger"
        self.ranks = RANKS
        self.script = script
        self._out = (tmp / "job.log").open("wb")
        port = str(free_port())
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), "--master-port", port] \
            if launcher == "torchrun" else [sys.executable]
        self.proc = subprocess.Popen(
            [*cmd, str(WORKLOADS / script)], stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True,
            cwd=WORKLOADS, env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": port, "FW_LOG": str(tmp),
                                "FW_GO": str(self.start_file), "FW_TRIGGER": str(self.trigger), **(env or {})})

    def events(self, rank: int, kind: str | None = None) -> list[dict]:
        return [e for e in rank_events(self.dir, rank) if kind is None or e["event"] == kind]

    def trigger_event(self, kind: str) -> int:
        return trigger_event(self.trigger, [self.events(r, "step") for r in range(self.ranks)], kind)

    def log_tail(self) -> str:
        return (self.dir / "job.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        kill_tree(self.proc)
        self._out.close()


def boundaries(events: list[dict], boundary: str = "optimizer") -> list[float]:
    """Where a rank's steps begin by its own log, at the boundary the agent says it uses:
    each Optimizer.step call, each zero_grad call, or each backward's start."""
    if boundary == "backward":
        return sorted(e["start"] for e in events if e["event"] == "block" and e["stage"] == "backward")
    return [e["call"] for e in events if e["event"] == ("zero_grad" if boundary == "zero_grad" else "step")]


def own_figures(events: list[dict], boundary: str = "optimizer") -> tuple[list[float], dict[str, float]]:
    """Step intervals and stage shares from a rank's own log: the k-th interval runs from
    the k-th boundary (an Optimizer.step call) to the next; a stage block counts in the
    interval it ends in, from the interval's start at the earliest (as a block open across
    a step's start). Blocks of other stages (a compiled update, which no probe sees) are
    left out."""
    calls = boundaries(events, boundary)
    intervals = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    total = sum(intervals)
    seconds = dict.fromkeys(STAGES, 0.0)
    k = 0
    for block in sorted((e for e in events if e["event"] == "block"), key=lambda e: e["end"]):
        while k + 1 < len(calls) and block["end"] >= calls[k + 1]:
            k += 1
        if block["stage"] in seconds and k + 1 < len(calls) and calls[k] <= block["end"]:
            seconds[block["stage"]] += block["end"] - max(block["start"], calls[k])
    return intervals, {stage: s / total for stage, s in seconds.items()}


@dataclass
class Watched:
    """A framework job and the agent on it, shared by a file's phases (tests, in order)."""

    job: FrameworkJob
    url: str
    agent: AgentProcess
    go: float = 0.0  # monotonic, when the go file was written
    notes: list[str] = field(default_factory=list)  # what each phase measured, printed at the end

    @contextlib.contextmanager
    def on_failure(self) -> Iterator[None]:
        """The job's and the agent's last lines when a phase fails (the job outlives a test)."""
        try:
            yield
        except BaseException:
            print("--- job log ---", self.job.log_tail(), "--- agent log ---",
                  "\n".join(self.agent.output.splitlines()[-60:]), sep="\n")
            with contextlib.suppress(Exception):  # what the agent held then: a help, never the failure
                print("--- findings ---", *((f["summary"], f["evidence"]) for f in findings(self.url)["findings"]),
                      "--- ranks ---", http_get(self.url + "/api/ranks")[:4000], sep="\n")
            raise


def watch(tmp: Path, script: str, launcher: str = "torchrun", env: dict[str, str] | None = None) -> Iterator[Watched]:
    """Start the job and an agent (stacks on: the user's lines come from them), start the
    steps once every rank is probed; stop both at the end."""
    job = FrameworkJob(tmp, script, launcher, env)
    agents: list[AgentProcess] = []

    def run_agent(args: list[str], env: dict[str, str] | None = None) -> AgentProcess:
        agents.append(AgentProcess(args, tmp, env))
        return agents[-1]

    try:
        try:
            url = attach(run_agent, job, extra=[])
        except BaseException:
            print("--- job log ---", job.log_tail(), *(a.output[-4000:] for a in agents), sep="\n")
            raise
        watched = Watched(job, url, agents[0])
        job.start_file.write_text("go")
        watched.go = time.monotonic()
        yield watched
        print(f"{script}:", *watched.notes, sep="\n  ")
    finally:
        for agent in agents:
            agent.stop()
        job.stop()


def healthy(w: Watched) -> None:
    """HEALTHY_SECONDS from the first step with no finding at any evaluation (read every
    half second; the evaluation counter proves the agent looked)."""
    with w.on_failure():
        wait_for(lambda: all(w.job.events(r, "step") for r in range(RANKS)), 120, interval=0.5, what="first steps")
        seen: set[int] = set()
        began = time.monotonic()
        while time.monotonic() - began < HEALTHY_SECONDS:
            answer = findings(w.url)
            seen.add(answer["evaluations"])
            assert answer["findings"] == [], [(f["summary"], f["evidence"]) for f in answer["findings"]]
            time.sleep(0.5)
        assert len(seen) >= HEALTHY_SECONDS * 0.75, len(seen)
        steps = [len(w.job.events(r, "step")) for r in range(RANKS)]
        w.notes.append(f"healthy: {HEALTHY_SECONDS:.0f} s, no finding over {len(seen)} evaluations, steps {steps}")


def figures_at_the_pause(w: Watched) -> None:
    """Every rank pauses in its save (60 s): the agent's figures, read then, against the
    job's own log up to its last step: count exact, p50 within 2%, shares within 2 points
    and summing to the whole."""
    with w.on_failure():
        w.job.trigger_event("pause")
        wait_for(lambda: all(w.job.events(r, "pause") for r in range(RANKS)), 60, interval=0.2, what="the pause")
        own = {r: w.job.events(r) for r in range(RANKS)}
        bound = step_boundaries(w.url)

        def caught_up() -> dict | None:
            # completed steps from the boundary the agent uses (Optimizer.step, or zero_grad
            # or the backward passes where a compiled step has no block): one less than them
            m = metrics(w.url)
            counts = [value(m, "profagent_step_seconds_count", rank=str(r)) for r in range(RANKS)]
            want = [float(len(boundaries(own[r], bound.get(str(r), "optimizer"))) - 1) for r in range(RANKS)]
            # events lost from the ring buffer (kernel probes are machine-wide: other jobs' hits share it) say why
            lost = value(m, "profagent_timeline_events_total", kind="lost")
            assert counts == want, f"the agent's completed steps {counts}, the job's {want} (boundaries {bound}, " \
                                   f"probe events lost {lost})"
            return m

        m = wait_for(caught_up, 20, interval=0.5, what="the agent's step count to reach the job's")
        for r in range(RANKS):
            intervals, shares = own_figures(own[r], bound.get(str(r), "optimizer"))
            total = value(m, "profagent_step_seconds_sum", rank=str(r)) or 1.0
            got = {s: round(value(m, "profagent_step_stage_seconds_total", stage=s, rank=str(r)) / total, 3)
                   for s in (*STAGES, "other")}
            w.notes.append(f"rank {r}: {len(intervals)} steps from {bound.get(str(r), 'optimizer')}, own p50 {sorted(intervals)[len(intervals) // 2]:.4f} s, "
                           f"agent p50 {value(m, 'profagent_step_window_seconds', stat='p50', rank=str(r))}; own shares "
                           f"{ {s: round(v, 3) for s, v in shares.items()} }, agent's {got}")
            check_figures(m, intervals, shares, r)


def step_boundaries(url: str) -> dict[str, str]:
    """Each rank's step boundary as /api/ranks says (ranks without one left out)."""
    rows = [r for j in json.loads(http_get(url + "/api/ranks"))["jobs"] for r in j["ranks"]]
    return {str(r["rank"]): r["timeline"]["step_boundary"] for r in rows
            if r.get("timeline") and r["timeline"].get("step_boundary")}


def pause(w: Watched) -> None:
    """The 60 s save on every rank: at most a stall warning naming the save's line, gone
    soon after the steps resume, never a hang."""
    with w.on_failure():
        begun = max(e["time"] for r in range(RANKS) for e in w.job.events(r, "pause"))
        save = w.job.events(0, "pause")[0]
        line = f"{save['function']} ({save['file']}:{save['line']})"
        warned: list[dict] = []
        while not all(w.job.events(r, "resumed") for r in range(RANKS)):
            found = findings(w.url)["findings"]
            assert not [f for f in found if f["finding"] == "hang"], found
            warned += [f for f in found if f["finding"] == "stall"]
            time.sleep(0.5)
        resumed = time.monotonic()
        wait_for(lambda: not findings(w.url)["findings"], 10, interval=0.5, what="the warning to clear")
        cleared = time.monotonic() - resumed
        w.notes.append(f"pause: {time.time() - begun:.0f} s, stall warnings {len(warned)}, cleared {cleared:.1f} s "
                       f"after the steps resumed; summary: {warned[-1]['summary'] if warned else '-'}")
        # the warning (30 s in) names the line every rank stands on
        assert warned and line in warned[-1]["summary"], (line, warned[-1:] and warned[-1]["summary"])


def straggler(w: Watched) -> None:
    """Rank 1's device then takes 1.5 times as long: named from its arrivals within a
    minute, and held (sampled every second), with no other finding."""
    with w.on_failure():
        w.job.trigger_event("straggle")
        wait_for(lambda: all(w.job.events(r, "straggle") for r in range(RANKS)), 60, interval=0.2,
                 what="every rank at the straggler's step")
        began = time.monotonic()

        def named() -> dict | None:
            return next((f for f in findings(w.url)["findings"] if f["finding"] == "straggler"), None)

        found = wait_for(named, NAMED_WITHIN, interval=1.0, what="the straggler named")
        named_after = time.monotonic() - began
        assert found["rank"] == "1" and found["evidence"].get("signal") == "arrivals", found
        assert found["evidence"]["last_share"] >= FindingsConfig().arrival_last_share, found
        gaps = []
        held_from = time.monotonic()
        while time.monotonic() - held_from < HELD_SECONDS:
            got = [(f["finding"], f["rank"]) for f in findings(w.url)["findings"]]
            if got != [("straggler", "1")]:
                gaps.append((round(time.monotonic() - began), got))
            time.sleep(1)
        w.notes.append(f"straggler: named after {named_after:.0f} s ({found['summary']}), gaps while held {gaps}")
        assert not gaps, gaps


def hang(w: Watched) -> None:
    """Rank 1 then stops for good in the user's own function: a stall warning naming rank 1
    and that line within LINE_WITHIN s of its last step, before any hang."""
    with w.on_failure():
        w.job.trigger_event("hang")
        truth = wait_for(lambda: next(iter(w.job.events(1, "hang")), None), 60, interval=0.2, what="rank 1 to stop")
        last_step = max(e["call"] for e in w.job.events(1, "step"))
        line = f"{truth['function']} ({truth['file']}:{truth['line']})"

        def warned() -> dict | None:
            found = findings(w.url)["findings"]
            assert not [f for f in found if f["finding"] == "hang"], found  # a hang only at stacks.stall_seconds
            return next((f for f in found if f["finding"] == "stall" and line in f["summary"]), None)

        found = wait_for(warned, LINE_WITHIN + 15, interval=0.5, what=f"a stall warning naming {line}")
        after = time.monotonic() - last_step
        w.notes.append(f"hang: warned {after:.0f} s after rank 1's last step: {found['summary']}")
        assert found["rank"] == "1", found
        assert after <= LINE_WITHIN, after
        assert after < StacksConfig().stall_seconds



def phase_tests(folder: str, script: str, launcher: str = "torchrun",
                env: dict[str, str] | None = None) -> dict[str, object]:
    """The module fixture ``watched`` and the five phase tests of one framework's file, in
    the phases' order: a test file takes them with ``globals().update(phase_tests(...))``."""
    import pytest

    @pytest.fixture(scope="module")
    def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Watched]:
        yield from watch(tmp_path_factory.mktemp(folder), script, launcher=launcher, env=env)

    @pytest.mark.timeout(240)
    def test_a_healthy_phase_gets_no_finding(watched: Watched) -> None:
        healthy(watched)

    @pytest.mark.timeout(120)
    def test_the_step_figures_match_the_jobs_own_callbacks(watched: Watched) -> None:
        figures_at_the_pause(watched)

    @pytest.mark.timeout(120)
    def test_a_checkpoint_pause_of_a_minute_never_becomes_a_hang(watched: Watched) -> None:
        pause(watched)

    @pytest.mark.timeout(180)
    def test_a_straggler_is_named_within_a_minute_and_held(watched: Watched) -> None:
        straggler(watched)

    @pytest.mark.timeout(120)
    def test_a_hang_is_warned_with_the_users_line(watched: Watched) -> None:
        hang(watched)

    return {f.__name__: f for f in (test_a_healthy_phase_gets_no_finding, test_the_step_figures_match_the_jobs_own_callbacks,
                                     test_a_checkpoint_pause_of_a_minute_never_becomes_a_hang,
                                     test_a_straggler_is_named_within_a_minute_and_held,
                                     test_a_hang_is_warned_with_the_users_line)} | {"watched": watched}

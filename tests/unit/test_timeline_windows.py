"""The timeline's incremental windows (analysis/timeline.py) against the figures read
afresh from every step, as the source did at each collect: ``StepWindow`` against
``window`` + ``quantile`` + sums, ``new_steps`` against ``match_arrivals`` over whole
histories, ``ArrivalWindow`` against ``summarize`` of the window's steps."""

from __future__ import annotations

import math
import random
from collections import deque

import pytest

from profagent.analysis import timeline as tl


def steps_of(rng: random.Random, count: int, start: float = 100.0, collectives: int = 2,
             offset: float = 0.0) -> list[tl.Step]:
    out, t = [], start
    for _ in range(count):
        seconds = rng.choice([0.05, 0.1, 0.1, 0.12, 0.3, 2.0]) * rng.uniform(0.9, 1.1)
        stages = {"data_wait": seconds * 0.1, "backward": seconds * rng.uniform(0.2, 0.5),
                  "optimizer": seconds * 0.05}
        stages["other"] = seconds - sum(stages.values())
        arrivals = tuple(t + offset + seconds * (k + 1) / (collectives + 1) + rng.uniform(0, 1e-3)
                         for k in range(collectives))
        out.append(tl.Step(t + offset, seconds, stages, rng.randint(1, 2), arrivals))
        t += seconds
    return out


@pytest.mark.parametrize("cap", [tl.RECENT_STEPS, 50])
def test_a_step_window_gives_the_figures_read_afresh_from_the_ranks_recent_steps(cap: int) -> None:
    rng = random.Random(cap)
    steps = steps_of(rng, 3000)
    recent: deque[tl.Step] = deque(maxlen=cap)
    window = tl.StepWindow(cap)
    total = 0
    for at in range(0, len(steps), 37):  # a collect every 37 steps, a 20 s window
        batch = steps[at:at + 37]
        recent.extend(batch)
        total += len(batch)
        now = batch[-1].start + batch[-1].seconds + rng.uniform(0, 0.5)
        window.follow(recent, total)
        window.expire(now - 20.0)
        fresh = tl.window(recent, now - 20.0)
        seconds = [s.seconds for s in fresh]
        assert list(window.steps) == fresh
        assert window.quantile(0.5) == tl.quantile(seconds, 0.5)
        assert window.quantile(0.9) == tl.quantile(seconds, 0.9)
        assert window.ordered[-1] == max(seconds)
        assert window.backwards == sum(s.backwards for s in fresh)
        assert window.span() == pytest.approx(fresh[-1].start + fresh[-1].seconds - fresh[0].start)
        whole = sum(seconds)
        for stage, share in window.shares().items():
            assert share == pytest.approx(sum(s.stages[stage] for s in fresh) / whole, rel=1e-9)


def test_a_step_window_starts_over_when_the_ranks_figures_do_and_empties_to_nothing() -> None:
    rng = random.Random(3)
    first: deque[tl.Step] = deque(steps_of(rng, 10))
    window = tl.StepWindow()
    window.follow(first, 10)
    assert len(window.steps) == 10
    again: deque[tl.Step] = deque(steps_of(rng, 4, start=500.0))  # RankTimeline begun again (_decide)
    window.follow(again, 4)
    assert list(window.steps) == list(again)
    window.expire(1e9)
    assert (window.steps, window.ordered, window.seconds, window.backwards) == (deque(), [], 0.0, 0)
    assert window.quantile(0.5) is None and window.shares() == {} and window.span() == 0.0


def test_new_steps_match_as_the_whole_histories_do() -> None:
    rng = random.Random(11)
    ranks = {str(r): steps_of(random.Random(7), 400, offset=r * 0.004 + rng.uniform(0, 1e-3)) for r in range(4)}
    ranks["2"] = ranks["2"][:-3]  # a rank behind: its last steps come later
    recent = {r: deque(s[:120]) for r, s in ranks.items()}
    after_whole = after_new = -math.inf
    for upto in range(120, 401, 23):
        for r, s in ranks.items():
            recent[r].extend(s[len(recent[r]):upto])
        whole, after_whole = tl.match_arrivals({r: list(d) for r, d in recent.items()}, after_whole)
        new, after_new = tl.match_arrivals(tl.new_steps(recent, after_new), after_new)
        assert new == whole and after_new == after_whole
    assert after_new > ranks["0"][-10].start


def test_new_steps_read_only_what_is_new() -> None:
    recent = {r: deque(steps_of(random.Random(1), 2000, offset=int(r) * 1e-3)) for r in ("0", "1")}
    after = recent["0"][-6].start
    got = tl.new_steps(recent, after)
    assert got["0"] == list(recent["0"])[-5:]
    reach = max(s.seconds for s in got["0"]) / 2  # rank 1's steps that may match one of them
    assert got["1"] == [s for s in recent["1"] if s.start >= after - reach] and len(got["1"]) < 40
    assert tl.new_steps({"0": recent["0"]}, after) == {"0": []}


def test_an_arrival_window_summarises_as_summarize_does_over_its_steps() -> None:
    rng = random.Random(9)
    folded = []
    for i in range(900):
        start = 100.0 + i * 0.1
        slow = "3" if rng.random() < 0.7 else rng.choice("012")
        arrivals = [tl.Arrival(start, k, {r: start + k * 0.01 + (0.004 if r == slow else rng.uniform(0, 2e-4))
                                         for r in "0123" if not (i % 97 == 0 and r == "2")})
                    for k in range(rng.randint(1, 4))]
        folded.extend(tl.fold_steps(arrivals))
    window = tl.ArrivalWindow(cap=400)
    kept: deque[tl.StepArrivals] = deque(maxlen=400)
    for at in range(0, len(folded), 31):
        window.extend(folded[at:at + 31])
        kept.extend(folded[at:at + 31])
        since = folded[min(at + 30, len(folded) - 1)].start - 25.0
        window.expire(since)
        while kept and kept[0].start < since:
            kept.popleft()
        assert list(window.steps) == list(kept)
        assert window.summary(0.1) == tl.summarize(list(kept), 0.1)
    window.expire(1e9)
    assert window.summary(0.1) == tl.LastArrivals(0, {}, {}, 0.1, {}, 0, {}, {})

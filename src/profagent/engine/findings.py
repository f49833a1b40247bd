"""The findings engine: evaluates every finding once per agent tick and publishes the
result in the job's State as ``"findings"`` (a ``FindingsSnapshot``).

It runs in the runtime's target thread (a hook, no thread of its own). Data flows one
way: source snapshots -> Evaluator -> State["findings"] -> exporters, /api/findings (exporters/api/findings.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from profagent.analysis.findings.evaluate import Evaluator
from profagent.config import FindingsConfig
from profagent.contracts import FindingsSnapshot
from profagent.state import State

NAME = "findings"


class FindingsEngine:
    def __init__(self, config: FindingsConfig, state: State,
                 wall: Callable[[], float] = time.time, clock: Callable[[], float] = time.monotonic) -> None:
        self.state = state
        self.evaluator = Evaluator(config)
        self._wall, self._clock = wall, clock

    def tick(self) -> FindingsSnapshot:
        began = self._clock()
        snapshot = self.evaluator.evaluate(self.state.view(), self._wall())
        self.state.publish(NAME, snapshot, self._clock() - began)
        return snapshot


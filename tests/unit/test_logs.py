"""The one log-once helper."""

from __future__ import annotations

import logging

from profagent.logs import LogOnce


def test_each_key_logs_once_until_forgotten(caplog) -> None:
    once = LogOnce(logging.getLogger("profagent.test"))
    with caplog.at_level(logging.INFO):
        assert once(logging.WARNING, "job-a", "job %s is big", "a")
        assert not once(logging.WARNING, "job-a", "job %s is big", "a")
        assert once(logging.INFO, "job-b", "job %s is big", "b")
        once.forget(lambda key: key != "job-a")
        assert once(logging.WARNING, "job-a", "job %s is big again", "a")
        assert not once(logging.INFO, "job-b", "job %s is big", "b")
    assert [r.getMessage() for r in caplog.records] == ["job a is big", "job b is big", "job a is big again"]

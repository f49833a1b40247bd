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


def test_rate_limit_holds_each_message_kind_to_its_burst_and_says_what_it_suppressed() -> None:
    """Issue 41 item 10: 821 "ignoring job" warnings in 50 s from 3,000 look-alikes. Each kind
    (logger, level, format string) gets ``burst`` lines per window; the rest are counted and
    the kind's next line says how many; other kinds and DEBUG lines are not held back."""
    import io
    import logging

    from profagent.logs import PrintableFormatter, RateLimit

    now = [0.0]
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(PrintableFormatter("%(levelname)s: %(message)s"))
    handler.addFilter(RateLimit(burst=3, window=60.0, clock=lambda: now[0]))
    logger = logging.getLogger("profagent.test_rate_limit")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        for pid in range(100):  # one kind, 100 lines in 50 s
            now[0] = pid * 0.5
            logger.warning("ignoring job %s (PID %d)", f"job{pid}", pid)
            logger.debug("looked at PID %d", pid)
        logger.error("another kind")
        now[0] = 60.0  # the next window: the next line says what was held back
        logger.warning("ignoring job %s (PID %d)", "late", 7)
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    ignoring = [line for line in lines if "ignoring job" in line]
    assert ignoring[:3] == ["WARNING: ignoring job job0 (PID 0)", "WARNING: ignoring job job1 (PID 1)",
                            "WARNING: ignoring job job2 (PID 2)"]
    assert ignoring[3:] == ["WARNING: ignoring job late (PID 7) (97 more like it suppressed in the last 60 s)"]
    assert sum(1 for line in lines if line.startswith("DEBUG: looked at PID")) == 100
    assert "ERROR: another kind" in lines

"""The one log-once helper."""

from __future__ import annotations

import datetime
import logging
import os
import re
import subprocess
import sys
import time

from profagent.logs import LogOnce, PrintableFormatter, rfc3339, stderr_is_journal


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


def test_rfc3339_is_utc_with_milliseconds() -> None:
    # 2026-11-28T12:00:00Z, independently: days from 1970-01-01 to 2026-11-28
    days = (datetime.date(2026, 11, 28) - datetime.date(1970, 1, 1)).days
    noon = days * 86400 + 12 * 3600
    assert rfc3339(noon + 0.1234) == "2026-11-28T12:00:00.123Z"
    assert rfc3339(noon + 59.9996) == "2026-11-28T12:00:59.999Z"  # truncated, never rounded into the next second
    assert rfc3339(noon) == "2026-11-28T12:00:00.000Z"
    parsed = datetime.datetime.fromisoformat(rfc3339(noon + 0.5).replace("Z", "+00:00"))
    assert parsed.timestamp() == noon + 0.5


def test_every_line_is_stamped_unless_journald_stamps_it(tmp_path) -> None:
    record = logging.LogRecord("profagent.x", logging.INFO, __file__, 1, "job %s ended", ("j",), None)
    record.created = 1_800_000_000.25
    stamped = PrintableFormatter("profagent %(levelname)s: %(message)s", timestamps=True).format(record)
    assert stamped == f"{rfc3339(1_800_000_000.25)} profagent INFO: job j ended"
    assert stamped.startswith("2027-01-15T08:00:00.250Z ")
    plain = PrintableFormatter("profagent %(levelname)s: %(message)s").format(record)
    assert plain == "profagent INFO: job j ended"


def test_journal_stream_must_name_stderr_itself(tmp_path) -> None:
    """systemd sets JOURNAL_STREAM=DEV:INO of the stream it connected; a child whose stderr
    was redirected elsewhere inherits the variable but not the stream."""
    path = tmp_path / "stream"
    path.write_text("")
    with open(path, "w") as journal, open(tmp_path / "elsewhere", "w") as other:
        st = os.fstat(journal.fileno())
        env = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        assert stderr_is_journal(env, journal.fileno())
        assert not stderr_is_journal(env, other.fileno())
        assert not stderr_is_journal({}, journal.fileno())
        for bad in ("", ":", "x:y", f"{st.st_dev}", f"{st.st_dev}:{st.st_ino}:1", f"-{st.st_dev}:{st.st_ino}"):
            assert not stderr_is_journal({"JOURNAL_STREAM": bad}, journal.fileno()), bad
        assert not stderr_is_journal(env, -1)  # no stderr file at all


def test_the_clis_log_setup_stamps_a_file_but_not_the_journal(tmp_path) -> None:
    code = ("import logging\nfrom profagent.cli import _setup_logging\n_setup_logging('info')\n"
            "logging.getLogger('profagent.x').warning('job %s ended', 'j')\n")

    def run(journal: bool) -> str:
        path = tmp_path / f"stderr-{journal}"
        with open(path, "w") as err:
            st = os.fstat(err.fileno())
            env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
            if journal:
                env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
            subprocess.run([sys.executable, "-c", code], stderr=err, env=env, check=True, timeout=60)
        return path.read_text()

    before = time.time()
    stamped = run(journal=False)
    match = re.fullmatch(r"(\S+) profagent WARNING: job j ended\n", stamped)
    assert match, stamped
    when = datetime.datetime.fromisoformat(match.group(1).replace("Z", "+00:00")).timestamp()
    assert before - 1 <= when <= time.time()
    assert run(journal=True) == "profagent WARNING: job j ended\n"

"""SIGHUP reloads the configuration in place: new rules apply, no series drop, bad files are refused."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from helpers.agent import free_port, http_get, parse_metrics
from helpers.processes import wait_for
from helpers.watch import FAKE_TORCHRUN, job_env, samples, token, watch_config


class Scraper(threading.Thread):
    """Scrapes /metrics back to back, recording for each scrape the job ids it saw."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.stop = threading.Event()
        self.seen: list[set[str] | None] = []  # None = the scrape failed

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                m = parse_metrics(http_get(self.base + "/metrics", timeout=2))
                self.seen.append({lab["job_id"] for lab, _ in samples(m, "profagent_process_cpu_seconds_total")})
            except Exception:
                self.seen.append(None)
            time.sleep(0.05)


@pytest.mark.slow
def test_sighup_applies_new_rules_without_a_gap(children, run_agent, tmp_path) -> None:
    tok_a, tok_b = token(), token()
    children.python(FAKE_TORCHRUN, env=job_env(tok_a, SLURM_JOB_ID="reload-a"))
    # Running before the agent starts: its first scan sees it and must leave it out.
    children.python(FAKE_TORCHRUN, env=job_env(tok_b, SLURM_JOB_ID="reload-b"))
    cfg = watch_config(tmp_path, tok_a)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    agent = run_agent(["watch", "--config", str(cfg), "--listen", f"127.0.0.1:{port}"])
    agent.wait_healthy(base)

    def jobs() -> set[str]:
        m = parse_metrics(http_get(base + "/metrics"))
        return {lab["job_id"] for lab, _ in samples(m, "profagent_target_up")}

    assert wait_for(lambda: jobs() == {"reload-a"} and jobs(), what="job a only") == {"reload-a"}
    assert "DEBUG" not in agent.output

    scraper = Scraper(base)
    scraper.start()
    wait_for(lambda: len(scraper.seen) >= 5, what="scrapes before the reload")
    before = len(scraper.seen)
    cfg.write_text(watch_config(tmp_path, tok_a, env_markers=[f"PAW_TOKEN={tok_a}", f"PAW_TOKEN={tok_b}"])
                   .read_text().replace("interval = 0.3\n", 'interval = 0.3\nlog_level = "debug"\n', 1))
    agent.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: jobs() == {"reload-a", "reload-b"}, what="job b found under the reloaded rules")
    wait_for(lambda: len(scraper.seen) >= before + 40, what="scrapes across the reload")
    scraper.stop.set()
    scraper.join(5)

    after = scraper.seen[before:]
    assert None not in after, "a scrape failed during the reload"
    assert all("reload-a" in s for s in after if s is not None), "job a's series had a gap"
    assert "configuration reloaded" in agent.output
    assert "DEBUG" in agent.output  # log_level = debug took effect
    assert agent.proc.poll() is None


@pytest.mark.slow
def test_a_bad_config_on_reload_keeps_the_old_one(children, run_agent, tmp_path) -> None:
    tok = token()
    children.python(FAKE_TORCHRUN, env=job_env(tok, SLURM_JOB_ID="reload-c"))
    cfg = watch_config(tmp_path, tok)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    agent = run_agent(["watch", "--config", str(cfg), "--listen", f"127.0.0.1:{port}"])
    agent.wait_healthy(base)
    wait_for(lambda: samples(parse_metrics(http_get(base + "/metrics")), "profagent_target_up", job_id="reload-c"),
             what="job c")
    good = cfg.read_text()

    cfg.write_text(good + "max_jobz = 3\n")
    agent.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "reload failed, keeping the previous configuration" in agent.output, what="refused reload")
    assert "did you mean 'watch.max_jobs'" in agent.output

    cfg.write_text(good.replace("interval = 0.3", "interval = 0.5", 1))  # not reloadable in place
    agent.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "interval changed; restart profagent to apply" in agent.output, what="restart hint")
    m = parse_metrics(http_get(base + "/metrics"))  # still serving on the old port
    assert samples(m, "profagent_target_up", job_id="reload-c") == [({"job_id": "reload-c"}, 1.0)]
    assert agent.proc.poll() is None and "Traceback" not in agent.output

"""Issue 41 item 6, the rest: each user's traces are read in turn, and a trace that never
completes gets a CPU budget as well as a deadline.

nobody's watched job fills the on-demand folder with 40 traces of its own (25,000 events
each, several rounds' reading in all on a fast node, of no watched process: read, analysed,
then skipped; written faster than they are read) and keeps appending to a ``.json.gz``
whose every read inflates megabytes and finds it incomplete. Root's job then
writes one trace. Bounds: of nobody's files still waiting when root's trace came, not all
were read before it (users in turn: at most the rest of the round it arrived in, a round
reading for up to 0.5 s; read in arrival order, every one of them would come first), and the endless file is counted invalid for its CPU budget
(``traces.incomplete_cpu_seconds = 0.5``), before its deadline (``invalid_after = 120``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from helpers.agent import free_port, http_get, parse_metrics, wait_for_ticks
from helpers.nobody import nobody_python
from helpers.processes import kill_tree, wait_for
from helpers.watch import job_env, samples, token, watch_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                       reason="plays a root agent against nobody: needs root and setpriv"),
]

FILES = 40
ATTACKER = """
import json, os, sys, time, zlib
folder = {folder!r}
events = [{{"ph": "X", "cat": "cpu_op", "name": f"op{{i % 50}}", "pid": 1, "tid": 1, "ts": i, "dur": 1}} for i in range(25000)]
text = json.dumps({{"traceEvents": events}})  # serialized once: the files come faster than they are read
while not os.path.exists(os.path.join(folder, "go")):
    time.sleep(0.05)
for n in range({files}):
    tmp = os.path.join(folder, f".n{{n}}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
    os.rename(tmp, os.path.join(folder, f"profagent_n{{n}}_1.json"))
endless = zlib.compressobj(wbits=31)
chunk = "".join(json.dumps(e) + ",\\n" for e in events).encode() * 4  # 40,000 more events a step, all read each time
with open(os.path.join(folder, "profagent_endless_1.json.gz"), "wb") as fh:
    fh.write(endless.compress(b'{{"traceEvents": ['))
    while True:
        fh.write(endless.compress(chunk) + endless.flush(zlib.Z_SYNC_FLUSH))
        fh.flush()
        time.sleep(0.7)
"""
VICTIM = "import time\nwhile True:\n    sum(range(3000))\n    time.sleep(0.02)\n"


def test_one_users_many_traces_and_an_endless_one_delay_no_other_users_trace(
        run_agent, children, tmp_path: Path) -> None:
    from test_security_attribution import trace_of

    tok = token()
    port = free_port()
    folder = Path(f"/tmp/paw-turns-{tok}")
    folder.mkdir()
    folder.chmod(0o1777)
    scripts = Path(tempfile.mkdtemp(prefix="paw-turns-scripts-"))
    scripts.chmod(0o755)
    cfg = watch_config(tmp_path, tok)
    cfg.write_text(cfg.read_text() + f'\n[ondemand]\ntrace_dir = "{folder}"\nsocket_dir = "{tmp_path}"\n'
                                     f'control_socket = "{tmp_path / "control.sock"}"\n'
                                     '[traces]\nincomplete_cpu_seconds = 0.5\nmax_events = 20000000\ninvalid_after = 120\n[timeline]\nenabled = false\n')
    url = f"http://127.0.0.1:{port}"
    attacker = None
    try:
        agent = run_agent(["watch", "--config", str(cfg), "--listen", f"127.0.0.1:{port}"])
        agent.wait_healthy(url, timeout=30)
        victim = children.python(VICTIM, env=job_env(tok, SLURM_JOB_ID="victim-41-6", RANK="0", WORLD_SIZE="1"))
        attacker = nobody_python(ATTACKER.format(folder=str(folder), files=FILES),
                                 {"PAW_TOKEN": tok, "SLURM_JOB_ID": "nobody-41-6", "RANK": "0", "WORLD_SIZE": "1"},
                                 scripts)
        wait_for(lambda: {"victim-41-6", "nobody-41-6"} <= {lab.get("job_id") for lab, v in parse_metrics(
            http_get(url + "/metrics")).get("profagent_target_up", []) if v == 1}, 30, what="both jobs watched")
        def totals() -> tuple[float, float, float]:
            parsed = parse_metrics(http_get(url + "/metrics"))
            rows = parsed.get("profagent_traces_total", [])
            ingested = sum(v for lab, v in rows if lab.get("status") == "ingested")
            budget = sum(v for lab, v in parsed.get("profagent_traces_rejected_total", [])
                         if lab.get("reason") == "cpu_budget")
            return ingested, sum(v for _, v in rows), budget

        time.sleep(1.0)  # the traces source's own tick has the victim's tree by now
        (folder / "go").touch()
        wait_for(lambda: len(list(folder.glob("profagent_n*_1.json"))) == FILES, 60, interval=0.01,
                 what="nobody's traces written")
        before = totals()[1]  # nobody's files handled before root's trace came
        staged = folder / f"profagent_v_{victim.pid}.json.tmp"
        staged.write_text(trace_of(victim.pid))
        staged.rename(folder / f"profagent_v_{victim.pid}.json")

        handled = wait_for(lambda: (t := totals())[0] >= 1 and t, 60, interval=0.1, what="root's trace ingested")
        backlog, meanwhile = FILES - before, handled[1] - 1 - before
        print(f"root's trace ingested after {meanwhile:.0f} of nobody's {backlog:.0f} files waiting")
        assert backlog >= 10, before  # a backlog to jump: the files come faster than they are read
        # not behind the whole backlog: at most the rest of the round it arrived in (a round
        # reads for up to WORK_SLICE, many small files on an idle node), then it comes first
        assert meanwhile < backlog, (before, handled)
        # its deadline (invalid_after) is 120 s from its first sight: its CPU budget ends it first
        wait_for(lambda: totals()[2] >= 1, 90, interval=0.5, what="the endless trace over its CPU budget")
        wait_for(lambda: totals()[1] >= FILES + 2, 60, interval=0.5, what="every file of nobody's handled, none lost")
        # counted once: its writer goes on appending, and it is not read (nor counted) again
        endless = folder / "profagent_endless_1.json.gz"
        size = endless.stat().st_size
        wait_for(lambda: endless.stat().st_size > size + 2 * 100_000, 30, interval=0.2, what="two more appends")
        wait_for_ticks(url, "traces", 2)
        assert totals()[1:] == (FILES + 2, 1), totals()
        assert samples(parse_metrics(http_get(url + "/metrics")), "profagent_traces_waiting") == [({}, 0.0)]
    finally:
        if attacker is not None:
            kill_tree(attacker)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(scripts, ignore_errors=True)

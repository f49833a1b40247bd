"""`profagent doctor` rows for the step timeline: capabilities, tracefs, and a probe that
really fires (a uprobe on this Python's own libc `getppid`, read back through perf)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

from profagent.config import Config
from profagent.doctor.check import FAIL, OK, WARN, Check
from profagent.sources.timeline.source import capability_problem
from profagent.system import elfsyms, perfevents, uprobes

FIX = "run profagent as root (the systemd unit and the DaemonSet of deploy/ do); see docs/timeline.md"


def check_timeline(config: Config) -> Iterator[Check]:
    if not config.timeline.enabled:
        yield Check("timeline", "kernel probes", WARN, "timeline.enabled = false", "remove --no-timeline")
        return
    problem = capability_problem()
    if problem:
        yield Check("timeline", "kernel probes", FAIL, problem, FIX)
        return
    tracefs = uprobes.find_tracefs(mount_if_missing=True)
    if tracefs is None:
        yield Check("timeline", "tracefs", FAIL, "not mounted and could not be mounted",
                    "mount -t tracefs nodev /sys/kernel/tracing")
        return
    yield Check("timeline", "tracefs", OK, str(tracefs))
    yield from _live_probe(tracefs)


def _live_probe(tracefs: Path) -> Iterator[Check]:
    """Place one probe on libc's getppid, call it, and read the hit back."""
    libc = next((line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                 if "libc.so" in line and " r-xp " in line), "")
    if not libc:
        yield Check("timeline", "live probe", WARN, "no libc mapped in this process to try a probe on")
        return
    with open(libc, "rb") as fh:
        lib = elfsyms.read_functions(fh, {"getppid": re.compile(rb"getppid")})
    functions = lib.functions.get("getppid", ())
    if not functions:
        yield Check("timeline", "live probe", WARN, f"no getppid in {libc} to try a probe on")
        return
    group = uprobes.new_group()
    reader = perfevents.TracepointReader(pages=1)
    try:
        tp = uprobes.define(tracefs, group, "doctor", libc, functions[0].file_offset)
        reader.add(tp)
        os.getppid()
        hits = [pid for _, pid, *_ in reader.read(0.5) if pid == os.getpid()]
        if hits:
            yield Check("timeline", "live probe", OK, "a uprobe fired and was read back")
        else:
            yield Check("timeline", "live probe", FAIL, "a uprobe was placed but no hit was read", FIX)
    except OSError as exc:
        yield Check("timeline", "live probe", FAIL, f"placing a uprobe failed: {exc.strerror or exc}", FIX)
    finally:
        reader.close()
        uprobes.remove(tracefs, group, "doctor")

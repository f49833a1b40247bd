"""/metrics latency over loopback against a large synthetic state.

    python bench/scrape.py [--requests 2000]

The state is built from the real snapshot types: 8 GPUs, 64 processes (8 ranks, each
with 7 DataLoader workers) and 50 stack functions per rank. Two cases, measured in the
same run:
- "warm": the state did not change since the last scrape (the rendered families are
  cached per state version, which is what happens when Prometheus scrapes faster than
  the sources tick);
- "cold": a source published just before every scrape, so each scrape renders all
  families from the snapshots.
Goal: p99 <= 5 ms on a 2-core machine.
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from synthetic import synthetic_state  # noqa: E402

from profagent.exporters.http import AgentHTTPServer  # noqa: E402
from profagent.exporters.prometheus import Exposition  # noqa: E402


def measure(port: int, n: int, before=None) -> list[float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    out = []
    for _ in range(n):
        if before:
            before()
        t0 = time.perf_counter()
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read()
        out.append(time.perf_counter() - t0)
        assert resp.status == 200 and body
    conn.close()
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()

    state, republish, description = synthetic_state()
    server = AgentHTTPServer("127.0.0.1", 0, Exposition(lambda: [state.view()]))
    server.start()
    try:
        body = http.client.HTTPConnection("127.0.0.1", server.port)
        body.request("GET", "/metrics")
        text = body.getresponse().read()
        series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
        measure(server.port, 50)  # warm up
        warm = measure(server.port, args.requests)
        cold = measure(server.port, max(200, args.requests // 4), before=republish)
    finally:
        server.shutdown()

    print(f"state: {description}; exposition {len(text) / 1024:.0f} KiB, {series} series")
    print(f"{'case':<6} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for name, xs in (("warm", warm), ("cold", cold)):
        print(f"{name:<6} {len(xs):>8} {pct(xs, 50):>8.2f} {pct(xs, 99):>8.2f} {statistics.mean(xs) * 1000:>8.2f}")
    print("goal: p99 <= 5 ms")


if __name__ == "__main__":
    main()

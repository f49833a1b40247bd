"""/metrics latency over loopback against a large synthetic state.

    python bench/scrape.py [--requests 2000]

The state is built from the real snapshot types: 8 GPUs, 64 processes (8 ranks, each
with 7 DataLoader workers) and 50 stack functions per rank. Three cases, measured in
the same run:
- "warm": nothing was published since the last scrape (Prometheus scraping faster than
  the sources tick): every block comes from the cache;
- "cold": every source published new snapshots just before each scrape; as in the agent,
  each publish encoded its snapshot in the publishing thread (``Exposition.prerender``),
  so the scrape joins blocks and renders only target, health and the agent's own families;
- "unprepared": the same without prerendering (the first scrape of a format): the scrape
  encodes every block itself.
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

from profagent.exporters.exposition import Exposition  # noqa: E402
from profagent.exporters.http import AgentHTTPServer  # noqa: E402


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
    exposition = Exposition(state.view)
    server = AgentHTTPServer("127.0.0.1", 0, exposition)
    server.start()
    try:
        body = http.client.HTTPConnection("127.0.0.1", server.port)
        body.request("GET", "/metrics")
        text = body.getresponse().read()
        series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
        measure(server.port, 50)  # warm up
        warm = measure(server.port, args.requests)
        # Not yet subscribed: every scrape after a publish encodes all blocks itself.
        unprepared = measure(server.port, max(200, args.requests // 4), before=republish)
        # As in the agent: each publish encodes its snapshot in the publishing thread.
        state.subscribe(exposition.prerender)
        cold = measure(server.port, max(200, args.requests // 4), before=republish)
    finally:
        server.shutdown()

    print(f"state: {description}; exposition {len(text) / 1024:.0f} KiB, {series} series")
    print(f"{'case':<10} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
    for name, xs in (("warm", warm), ("cold", cold), ("unprepared", unprepared)):
        print(f"{name:<10} {len(xs):>8} {pct(xs, 50):>8.2f} {pct(xs, 99):>8.2f} {statistics.mean(xs) * 1000:>8.2f}")
    print("goal: p99 <= 5 ms")


if __name__ == "__main__":
    main()

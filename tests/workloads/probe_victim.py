"""A training process that does everything the kernel probes must not break: it forks,
starts threads, runs DataLoader workers and a subprocess, loads torch late if asked, and
logs what worked.

usage: probe_victim.py --truth FILE --go-file FILE [--import-after FILE] [--steps N]

With --import-after it runs without torch until that file exists, then imports it and
writes FILE.imported. It waits for --go-file before its first step, then trains --steps
steps in the main thread, then checks fork(), threads that train, DataLoader workers and
a subprocess while the probes are on, and writes --truth as JSON.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from lifeline import bound

parser = argparse.ArgumentParser()
parser.add_argument("--truth", required=True)
parser.add_argument("--go-file", required=True)
parser.add_argument("--import-after", default="")
parser.add_argument("--steps", type=int, default=50)
args = parser.parse_args()


def wait(path: str) -> None:
    while not Path(path).exists():
        time.sleep(0.05)


def main() -> None:
    bound(300)
    if args.import_after:
        wait(args.import_after)
    import torch  # noqa: PLC0415 (late on purpose: libtorch is mapped after the agent looked)

    Path(args.truth + ".imported").write_text("yes")
    wait(args.go_file)
    net = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    def train(n: int) -> None:
        for _ in range(n):
            with torch.autograd.profiler.record_function("my_region"):
                net(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()

    train(args.steps)
    truth: dict[str, object] = {"steps": args.steps}
    # fork while probed: the child trains and exits 0 (an inherited probe made fork fail)
    codes = []
    for _ in range(3):
        pid = os.fork()
        if pid == 0:
            try:
                torch.nn.Linear(8, 1)(torch.randn(2, 8)).sum().backward()
                os._exit(0)
            except BaseException:
                os._exit(3)
        codes.append(os.waitpid(pid, 0)[1])
    truth["fork_status"] = codes
    # threads while probed, each running its own backward
    done = []
    threads = [threading.Thread(target=lambda: done.append(torch.nn.Linear(8, 1)(torch.randn(2, 8)).sum().backward()))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    truth["threads_done"] = len(done)
    # DataLoader workers (fork) and a subprocess
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8)), batch_size=8, num_workers=2)
    truth["batches"] = sum(1 for _ in data)
    truth["subprocess"] = subprocess.run([sys.executable, "-c", "print('ok')"], capture_output=True, text=True,
                                         timeout=60).stdout.strip()
    Path(args.truth).write_text(json.dumps(truth))


if __name__ == "__main__":
    main()

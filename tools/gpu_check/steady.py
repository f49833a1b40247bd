"""One process: BUSY_S seconds of back-to-back bf16 matrix products (the GPU busy all the
time), then IDLE_S seconds asleep holding its memory. Ground truth: the phases' start
times to GT_DIR/steady.jsonl."""

import json
import os
import time

import torch


def main() -> None:
    truth = open(os.path.join(os.environ["GT_DIR"], "steady.jsonl"), "a", buffering=1)  # noqa: SIM115
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    truth.write(json.dumps({"event": "busy", "time": time.time(), "pid": os.getpid()}) + "\n")
    end = time.time() + float(os.environ.get("BUSY_S", "30"))
    products = 0
    while time.time() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
        products += 20
    truth.write(json.dumps({"event": "idle", "time": time.time(), "products": products}) + "\n")
    time.sleep(float(os.environ.get("IDLE_S", "20")))
    truth.write(json.dumps({"event": "done", "time": time.time()}) + "\n")


if __name__ == "__main__":
    main()

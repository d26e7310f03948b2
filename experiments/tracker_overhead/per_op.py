"""What the memory tracker costs per ATen op, split into the dispatch-mode machinery and its own
bookkeeping, on a loop of small ops (so the op itself costs little).

    python experiments/tracker_overhead/per_op.py [--iters 5000] [--rounds 9]

Each round runs the same loop with no mode, under an empty ``TorchDispatchMode`` (what any Python
dispatch mode costs: PyTorch's C++ -> Python call per op) and under ``MemoryTracker``; rounds
alternate and the minimum per configuration is kept (the least disturbed round on a shared machine).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from experiments.common import machine_line, table  # noqa: E402
from memopt.memory.tracker import MemoryTracker  # noqa: E402


class EmptyMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    x = torch.randn(16, 16)

    def loop() -> None:
        y = x
        for _ in range(args.iters):
            y = (y + 1.0).t().contiguous()  # a new storage, a view, a copy
            y.mul_(0.5)  # in place

    ops = 4 * args.iters
    modes = {"no mode": contextlib.nullcontext, "empty dispatch mode": EmptyMode, "MemoryTracker": lambda: MemoryTracker("cpu")}
    best = {k: float("inf") for k in modes}
    for _ in range(args.rounds):
        for name, make in modes.items():
            t = time.perf_counter()
            with make():
                loop()
            best[name] = min(best[name], (time.perf_counter() - t) / ops * 1e6)
    print(machine_line())
    print(f"{ops} ops per round, {args.rounds} rounds, minimum per configuration\n")
    base = best["no mode"]
    print(table(["configuration", "us/op", "added us/op"], [[k, f"{v:.2f}", f"{v - base:.2f}"] for k, v in best.items()]))


if __name__ == "__main__":
    main()

"""Cost of the dispatch-mode memory tracker: the same job with trainer.track_memory on and off.

    python experiments/tracker_overhead/bench.py [--model gpt_tiny] [--rounds 3]

Runs alternate (off, on, off, on, ...) so that machine noise hits both sides; prints the median
step time of each side and the ratio on/off.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from experiments.common import bench_dir, machine_line, wandb_overrides  # noqa: E402
from memopt.api import run_job  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt_tiny")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=16)
    args = ap.parse_args()
    base = [f"model={args.model}", "data=synthetic", *wandb_overrides("tracker_overhead"), f"trainer.max_steps={args.steps}", "trainer.eval_every=0",
            f"trainer.micro_batch_size={args.micro_batch}", "trainer.progress_bar=false", "trainer.save_checkpoint=false"]
    times = {True: [], False: []}
    tmp = bench_dir("tracker_overhead")
    for r in range(args.rounds):
        for on in (False, True):
            s = run_job(base + [f"trainer.track_memory={str(on).lower()}"], os.path.join(tmp, f"{r}{on}"))
            times[on].append(s["step_time_s"])
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(machine_line())
    print(f"model={args.model} micro_batch={args.micro_batch} steps={args.steps} rounds={args.rounds}")
    print(f"| tracker | median step time (ms) |\n|---|---|\n| off | {off * 1e3:.1f} |\n| on | {on * 1e3:.1f} |")
    print(f"ratio on/off: {on / off:.3f}")


if __name__ == "__main__":
    main()

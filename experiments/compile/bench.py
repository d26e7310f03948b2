"""Eager against compiled blocks on gpt_small (CPU, fp32): peak activation bytes, step time, and the
bytes the rematerialization saved against the analytic count of the point-wise outputs.

    python experiments/compile/bench.py [--steps 4] [--micro-batch 2]

Rows: eager, then ``+strategy=compile`` with each ``remat`` setting. The analytic column is what
``remat=pointwise`` drops per GPT block: the two LayerNorm outputs (B T C values each) and GELU's
output (B T 4C), i.e. L * 6 B T C * 4 bytes in fp32 (the README derives it). Step time is the
median of the steps after the first (which holds the compilation); the first step's time is given
apart as the compile cost.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from experiments.common import bench_dir, machine_line, mib, table  # noqa: E402
from memopt.api import compose_config, run_job  # noqa: E402

ROWS = {
    "eager": [],
    "compile remat=inductor": ["+strategy=compile", "strategy.compile.remat=inductor"],
    "compile remat=pointwise": ["+strategy=compile", "strategy.compile.remat=pointwise"],
    "compile remat=aggressive": ["+strategy=compile", "strategy.compile.remat=aggressive"],
}


def step_times(run_dir: str) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step_time_s"] for line in f if "step_time_s" in line]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--model", default="gpt_small")
    args = ap.parse_args()
    base = [f"model={args.model}", "data=synthetic", "logger=none", f"trainer.max_steps={args.steps}",
            "trainer.eval_every=0", "trainer.log_every=1", f"trainer.micro_batch_size={args.micro_batch}",
            "trainer.progress_bar=false", "trainer.save_checkpoint=false"]
    m = compose_config(base).model
    B, T, C, L = args.micro_batch, m.seq_len, m.d_model, m.n_layer
    pointwise = L * (C + C + 4 * C) * B * T * 4
    root = bench_dir("compile")
    rows, eager_act = [], None
    for i, (name, extra) in enumerate(ROWS.items()):
        d = os.path.join(root, str(i))
        t0 = time.perf_counter()
        s = run_job(base + extra, d)
        wall = time.perf_counter() - t0
        p = s["peak_bytes"]["0"]["cpu"]
        st = step_times(d)
        eager_act = p["activations"] if eager_act is None else eager_act
        rows.append([name, mib(p["params"]), mib(p["grads"]), mib(p["optim"]), mib(p["activations"]),
                     mib(eager_act - p["activations"]), f"{st[0]:.2f}", f"{statistics.median(st[1:]):.3f}",
                     f"{wall:.0f}", f"{s['final_loss']:.5f}"])
        print(f"done: {name}", file=sys.stderr)
    print(machine_line())
    print(f"{args.model}: L={L} C={C} T={T} B={B}; analytic point-wise outputs (remat=pointwise): {mib(pointwise)} MiB\n")
    print(table(["run", "params MiB", "grads MiB", "optim MiB", "activations MiB", "saved vs eager MiB",
                 "first step s", "step s (median)", "job s", "final loss"], rows))


if __name__ == "__main__":
    main()

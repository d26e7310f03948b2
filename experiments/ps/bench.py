"""Parameter server (``+strategy=ps``) against all-reduce (``+strategy=ddp``) on 2 and 4 gloo ranks:
bytes per step through the busiest rank (measured by the collectives counter, and the wire bytes each
form implies) and step time.

    python experiments/ps/bench.py [--model gpt_tiny] [--steps 5] [--ranks 2,4] [--seq-len 64]

Rank 0 is ddp's ring member and ps's server; its counter gives the payload of every operation it ran
in the first step. Wire bytes per step on rank 0's link (P fp32 parameters, N ranks):
    ddp (ring all-reduce)   2 (N-1)/N x 4P    sent, and as much received
    ps server               (N-1) x 4P received (gradients) and (N-1) x 4P sent (weights)
Step time is the median of the steps after the first.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from experiments.common import bench_dir, machine_line, mib, table  # noqa: E402
from memopt.api import run_jobs_on_ranks  # noqa: E402


def step_times(run_dir: str) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step_time_s"] for line in f if "step_time_s" in line]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt_tiny")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--seq-len", type=int, default=None, help="shorter sequences: less compute, so the traffic shows")
    args = ap.parse_args()
    base = [f"model={args.model}", "data=synthetic", "logger=none", f"trainer.max_steps={args.steps}", "trainer.eval_every=0",
            "trainer.log_every=1", "trainer.micro_batch_size=2", "trainer.progress_bar=false",
            "trainer.save_checkpoint=false", "trainer.count_comm=true"]
    if args.seq_len:
        base.append(f"model.seq_len={args.seq_len}")
    root, rows = bench_dir("ps"), []
    for n in (int(r) for r in args.ranks.split(",")):
        jobs = [(base + [f"+strategy={s}"], os.path.join(root, f"{s}_{n}")) for s in ("ddp", "ps")]
        for (_, d), s in zip(jobs, run_jobs_on_ranks(n, jobs)):
            assert s["status"] == "ok", s
            name = os.path.basename(d).split("_")[0]
            P = s["params"]
            ops = s["comm_per_step"]["ops"]
            g = 4 * P
            wire = 2 * (n - 1) / n * g if name == "ddp" else (n - 1) * g
            st = step_times(d)
            rows.append([name, n, mib(ops.get("all_reduce", {}).get("bytes", 0)), mib(ops.get("recv", {}).get("bytes", 0)),
                         mib(ops.get("send", {}).get("bytes", 0)), mib(wire), mib(wire),
                         mib(s["peak_bytes"]["0"]["cpu"]["optim"]), mib(s["peak_bytes"][str(n - 1)]["cpu"].get("optim", 0)),
                         f"{statistics.median(st[1:]):.3f}", f"{s['final_loss']:.6f}"])
            print(f"done: {name} x{n}", file=sys.stderr)
    print(machine_line())
    print(f"{args.model}{f' seq_len {args.seq_len}' if args.seq_len else ''}, micro-batch 2 per rank, fp32\n")
    print(table(["form", "ranks", "rank 0 all-reduce payload MiB", "rank 0 recv MiB", "rank 0 send MiB",
                 "rank 0 wire in MiB (formula)", "rank 0 wire out MiB (formula)", "rank 0 optim MiB",
                 "last rank optim MiB", "step s (median)", "final loss"], rows))


if __name__ == "__main__":
    main()

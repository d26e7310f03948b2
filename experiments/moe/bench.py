"""Dense vs MoE at the same active parameter count, ep=1 vs ep=2, memopt vs DeepSpeed-MoE: one launch.

    python experiments/moe/bench.py [--steps 4] [--micro-batch 2] [--dense gpt_small --moe moe_small]

Every job runs on 2 ranks (gloo on CPU, NCCL on GPU) with ZeRO-2, fp32, the same data and seed, one
after the other in one launch. Prints, per job: rank 0's peak MiB per category on the compute device
(``comm``: the all_to_all buffers), total and active parameters, median tokens/s, MFU (active FLOPs),
the ratios to the dense memopt row, memopt / DeepSpeed-MoE ratios, and the loss trajectories.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from experiments.common import bench_dir, machine_line, mib, table, wandb_overrides  # noqa: E402
from memopt.api import run_jobs_on_ranks  # noqa: E402

CATS = ("params", "grads", "optim", "activations", "temp", "comm", "total")


def configs(dense: str, moe: str) -> dict[str, list[str]]:
    return {
        "dense memopt": [f"model={dense}", "engine=memopt"],
        "dense deepspeed": [f"model={dense}", "engine=deepspeed"],
        "moe ep=1 memopt": [f"model={moe}", "engine=memopt"],
        "moe ep=1 deepspeed": [f"model={moe}", "engine=deepspeed"],
        "moe ep=2 memopt": [f"model={moe}", "engine=memopt", "parallel.ep=2"],
        "moe ep=2 deepspeed": [f"model={moe}", "engine=deepspeed", "parallel.ep=2"],
    }


def losses(run_dir: str) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--dense", default="gpt_small")
    ap.add_argument("--moe", default="moe_small")
    ap.add_argument("--capacity-factor", type=float, default=None, help="strategy.moe.capacity_factor (preset's default if unset)")
    args = ap.parse_args()
    base = ["data=synthetic", *wandb_overrides("moe"), "+strategy=zero2", f"trainer.max_steps={args.steps}",
            "trainer.eval_every=0", "trainer.log_every=1", f"trainer.micro_batch_size={args.micro_batch}",
            "trainer.progress_bar=false", "trainer.save_checkpoint=false", "trainer.throughput_warmup_steps=1"]
    cap = [f"strategy.moe.capacity_factor={args.capacity_factor}"] if args.capacity_factor else []
    out = bench_dir("moe")
    jobs, names = [], []
    for name, extra in configs(args.dense, args.moe).items():
        names.append(name)
        jobs.append((base + extra + (cap if name.startswith("moe") else []), os.path.join(out, name.replace(" ", "_").replace("=", ""))))
    summaries = dict(zip(names, run_jobs_on_ranks(2, jobs)))

    ref = summaries["dense memopt"]
    dev = next(d for d in ref["peak_bytes"]["0"] if d != "host")
    head = ["job", "params M (active)"] + [f"{c} MiB" for c in CATS] + ["tokens/s", "MFU", "total vs dense", "tok/s vs dense", "memopt/ds total", "memopt/ds tok/s"]
    rows = []
    for name in names:
        s = summaries[name]
        cats = s["peak_bytes"]["0"][dev]
        twin = name.replace("memopt", "deepspeed") if name.endswith("memopt") else None
        t = summaries.get(twin) if twin else None
        rows.append([name, f"{s['params'] / 1e6:.1f} ({s['active_params'] / 1e6:.1f})"] + [mib(cats.get(c, 0)) for c in CATS] + [
            f"{s['tokens_per_s']:,.0f}", f"{s['mfu']:.1%}" if s.get("mfu") else "-",
            f"{cats['total'] / ref['peak_bytes']['0'][dev]['total']:.2f}", f"{s['tokens_per_s'] / ref['tokens_per_s']:.2f}",
            f"{cats['total'] / t['peak_bytes']['0'][dev]['total']:.2f}" if t else "",
            f"{s['tokens_per_s'] / t['tokens_per_s']:.2f}" if t else ""])
    print(machine_line())
    print(f"dense={args.dense} moe={args.moe} ranks=2 zero2 fp32 micro_batch={args.micro_batch} steps={args.steps} "
          f"(tokens/s: median after step 1); peaks of rank 0 on {dev}")
    print(table(head, rows))
    print("\nloss per step")
    print(table(["job"] + [f"step {i}" for i in range(args.steps)],
                [[n] + [f"{v:.4f}" for v in losses(j[1])] for n, j in zip(names, jobs)]))


if __name__ == "__main__":
    main()

"""ddp, ZeRO 1-3 and ZeRO-Offload side by side on gpt_small with 2 ranks (gloo on CPU, NCCL on GPU).

    python experiments/zero/bench.py [--steps 4] [--micro-batch 2] [--nproc 2]

All configurations run in one launch of the ranks, one after the other, on the same model, data
and seed. Prints peak MiB per category on the compute device for each rank (and the host total),
median tokens/s, and each row's ratios to ddp.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from experiments.common import bench_dir, machine_line, wandb_overrides  # noqa: E402
from memopt.api import run_jobs_on_ranks  # noqa: E402

CONFIGS = {
    "ddp": ["+strategy=ddp"],
    "zero1": ["+strategy=zero1"],
    "zero2": ["+strategy=zero2"],
    "zero3": ["+strategy=zero3"],
    "zero2+cpu_offload": ["+strategy=[zero2,cpu_offload]"],
    "zero3+cpu_offload": ["+strategy=[zero3,cpu_offload]"],
}
CATS = ("params", "grads", "optim", "activations", "temp", "total")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--model", default="gpt_small")
    args = ap.parse_args()
    base = [f"model={args.model}", "data=synthetic", *wandb_overrides("zero"), f"trainer.max_steps={args.steps}", "trainer.eval_every=0",
            f"trainer.micro_batch_size={args.micro_batch}", "trainer.progress_bar=false", "trainer.save_checkpoint=false",
            "trainer.throughput_warmup_steps=1"]
    tmp = bench_dir("zero")
    summaries = run_jobs_on_ranks(args.nproc, [(base + extra, os.path.join(tmp, n.replace("+", "_"))) for n, extra in CONFIGS.items()])
    head = ["config", "rank"] + [f"{c} MiB" for c in CATS] + ["host MiB", "tokens/s", "total vs ddp", "speed vs ddp"]
    rows = [head]
    ref_total = {r: summaries[0]["peak_bytes"][r]["cpu" if "cpu" in summaries[0]["peak_bytes"][r] else next(iter(summaries[0]["peak_bytes"][r]))]["total"] for r in summaries[0]["peak_bytes"]}
    ref_tok = summaries[0]["tokens_per_s"]
    for name, s in zip(CONFIGS, summaries):
        for rank, devs in sorted(s["peak_bytes"].items()):
            dev = next(d for d in devs if d != "host")
            cats = devs[dev]
            rows.append([name, rank] + [f"{cats[c] / 2**20:.1f}" for c in CATS] +
                        [f"{devs.get('host', {}).get('total', 0) / 2**20:.1f}", f"{s['tokens_per_s']:,.0f}",
                         f"{cats['total'] / ref_total[rank]:.2f}", f"{s['tokens_per_s'] / ref_tok:.2f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    print(machine_line())
    print(f"model={args.model} ranks={args.nproc} micro_batch={args.micro_batch} steps={args.steps}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows[1:]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


if __name__ == "__main__":
    main()

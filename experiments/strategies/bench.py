"""Single-process strategies side by side on gpt_small: peak bytes by category and tokens/s.

    python experiments/strategies/bench.py [--steps 4] [--micro-batch 4]

Every configuration runs in this process, one after the other, on the same model, data and seed;
the table gives peak MiB per category on the compute device (and the host copy for act_offload),
median tokens/s after the first step, and the ratio to the plain fp32 run.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from experiments.common import bench_dir, machine_line, wandb_overrides  # noqa: E402
from memopt.api import run_job  # noqa: E402

CONFIGS = {
    "plain fp32": [],
    "fp16": ["+strategy=fp16", "strategy.fp16.init_scale=1024"],
    "bf16 (autocast)": ["+strategy=bf16"],
    "bf16 params": ["+strategy=bf16", "strategy.bf16.params=bf16"],
    "ckpt full": ["+strategy=ckpt"],
    "ckpt every_k (k=3)": ["+strategy=ckpt", "strategy.ckpt.policy=every_k"],
    "ckpt selective": ["+strategy=ckpt", "strategy.ckpt.policy=selective"],
    "ckpt full + act_offload": ["+strategy=[ckpt,act_offload]"],
    "bf16 params + ckpt + act_offload": ["+strategy=[bf16,ckpt,act_offload]", "strategy.bf16.params=bf16"],
}
CATS = ("params", "grads", "optim", "activations", "temp", "other", "total")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--attention", default="sdpa")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated row names (default: every row; "
                    "'plain fp32' is always run first as the reference)")
    args = ap.parse_args()
    base = [f"model={args.model}", f"model.attention={args.attention}", "data=synthetic", *wandb_overrides("strategies"),
            f"trainer.max_steps={args.steps}", "trainer.eval_every=0", f"trainer.micro_batch_size={args.micro_batch}",
            "trainer.progress_bar=false", "trainer.save_checkpoint=false", "trainer.throughput_warmup_steps=1"]
    rows = []
    tmp = bench_dir("strategies")
    chosen = ["plain fp32"] + [c for c in args.configs.split(",") if c != "plain fp32"]
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown row(s) {unknown}; choose from {list(CONFIGS)}")
    for i, name in enumerate(chosen):
        extra = CONFIGS[name]
        s = run_job(base + extra, os.path.join(tmp, str(i)))
        dev = next(d for d in s["peak_bytes"]["0"] if d != "host")
        rows.append((name, s["peak_bytes"]["0"][dev], s["peak_bytes"]["0"].get("host", {}).get("total", 0), s["tokens_per_s"], s["final_loss"]))
        print(f"done: {name}", file=sys.stderr)
    plain_total, plain_tok = rows[0][1]["total"], rows[0][3]
    head = ["config"] + [f"{c} MiB" for c in CATS] + ["host MiB", "tokens/s", "mem vs plain", "speed vs plain", "loss"]
    table = [head]
    for name, cats, host, tok, loss in rows:
        table.append([name] + [f"{cats[c] / 2**20:.1f}" for c in CATS] + [f"{host / 2**20:.1f}", f"{tok:,.0f}",
                     f"{cats['total'] / plain_total:.2f}", f"{tok / plain_tok:.2f}", f"{loss:.4f}"])
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    print(machine_line())
    print(f"model={args.model} attention={args.attention} micro_batch={args.micro_batch} steps={args.steps}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in table[1:]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


if __name__ == "__main__":
    main()

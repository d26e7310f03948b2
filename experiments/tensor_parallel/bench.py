"""Tensor parallelism vs data parallelism on 2 ranks for the same model (fp32, gloo on CPU).

    python experiments/tensor_parallel/bench.py [--model gpt_small] [--steps 4] [--micro-batch 2] [--seq-len 256]

All configurations run in one launch of the ranks, one after the other, on the same model, data and
seed: dp=2 (ddp), zero3 over 2 ranks, and tp=2 in the seed's two forms (all_reduce: Megatron
column-then-row; all_gather: every Linear column-split and gathered), the all_reduce form also with
sequence parallelism. Each job counts the collectives of its step 0 (``trainer.count_comm``: calls
and payload bytes per kind, as issued by rank 0). The data-parallel rows process 2x the tokens per
step of the tp rows (each tp rank sees the same micro-batch), so tokens/s compares throughput of the
two ranks together.

Payload bytes are what the collectives were called with (all-reduce and reduce-scatter: the input,
all-gather: the gathered output). On a ring of n ranks each rank sends 2(n-1)/n of an all-reduce's
payload and (n-1)/n of an all-gather's or reduce-scatter's: the "sent/rank" column applies these
factors to the measured payloads (n = the collective's group size, 2 for every collective here).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from experiments.common import bench_dir, machine_line, table, wandb_overrides  # noqa: E402
from memopt.api import run_jobs_on_ranks  # noqa: E402

TP = ["+strategy=tp", "parallel.tp=2"]
CONFIGS = {
    "dp=2 (ddp)": ["+strategy=ddp"],
    "zero3": ["+strategy=zero3"],
    "tp=2 all_reduce": TP,
    "tp=2 all_reduce+sp": TP + ["strategy.tp.sequence_parallel=true"],
    "tp=2 all_gather": TP + ["strategy.tp.form=all_gather"],
}
CATS = ("params", "grads", "optim", "activations", "temp", "total")
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def sent(ops: dict, n: int) -> float:
    """Bytes one rank sends on a ring of n ranks for these payloads (see the module docstring)."""
    f = (n - 1) / n
    return sum(v["bytes"] * (2 * f if k == "all_reduce" else f) for k, v in ops.items())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    base = [f"model={args.model}", f"model.seq_len={args.seq_len}", "data=synthetic", *wandb_overrides("tensor_parallel"),
            f"trainer.max_steps={args.steps}", "trainer.eval_every=0", f"trainer.micro_batch_size={args.micro_batch}",
            "trainer.progress_bar=false", "trainer.save_checkpoint=false", "trainer.throughput_warmup_steps=1",
            "trainer.count_comm=true"]
    out = bench_dir("tensor_parallel")
    summaries = run_jobs_on_ranks(2, [(base + extra, os.path.join(out, f"job{i}")) for i, extra in enumerate(CONFIGS.values())])
    ref = summaries[0]
    rows = []
    for name, s in zip(CONFIGS, summaries):
        cats = s["peak_bytes"]["0"]["cpu"]
        comm = s["comm_per_step"]
        rows.append([name] + [f"{cats[c] / 2**20:.1f}" for c in CATS] +
                    [f"{s['tokens_per_s']:,.0f}", f"{s['step_time_s']:.2f}"] +
                    [f"{comm['ops'].get(k, {}).get('bytes', 0) / 2**20:.2f} ({comm['ops'].get(k, {}).get('count', 0)})"
                     for k in KINDS] +
                    [f"{comm['bytes'] / 2**20:.2f}", f"{sent(comm['ops'], 2) / 2**20:.2f}",
                     f"{cats['total'] / ref['peak_bytes']['0']['cpu']['total']:.2f}",
                     f"{s['tokens_per_s'] / ref['tokens_per_s']:.2f}"])
    print(machine_line())
    print(f"model={args.model} seq_len={args.seq_len} ranks=2 micro_batch={args.micro_batch} steps={args.steps} fp32; "
          f"peaks of rank 0; collectives of rank 0's step 0: MiB (calls)")
    print(table(["config"] + [f"{c} MiB" for c in CATS] + ["tokens/s", "step s"] + [f"{k} MiB" for k in KINDS] +
                ["payload MiB/step", "sent/rank MiB", "total vs dp", "speed vs dp"], rows))


if __name__ == "__main__":
    main()

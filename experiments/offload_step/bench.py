"""ZeRO-Offload's optimizer step: memopt's against DeepSpeed's, side by side on the same job.

    python experiments/offload_step/bench.py [--model gpt_small] [--steps 4] [--repeats 2] [--dtype bf16]

One rank, zero2 + cpu_offload, the same model, data, seed and precision, jobs alternating between
repeats (the order rotates). "optim step s" is the trainer's clock around ``engine.step`` (median
after the warm-up steps, best repeat; worst in parentheses): for memopt the host step (norm, then one
fused pass: unscale, clip, weight decay, Adam, bf16 copy into the parameters) and the all-gather;
for DeepSpeed ``engine.step()`` with ``DeepSpeedCPUAdam``. Gradients reach the host during the
backward in both, so that copy is in the s/step column, not in the optim step.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from experiments.common import bench_dir, machine_line, mib, table, wandb_overrides  # noqa: E402
from memopt.api import run_job  # noqa: E402

DTYPE = {"bf16": ["+strategy=[zero2,cpu_offload,bf16]", "strategy.bf16.params=bf16"],
         "fp16": ["+strategy=[zero2,cpu_offload,fp16]", "strategy.fp16.init_scale=1024"],
         "fp32": ["+strategy=[zero2,cpu_offload]"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPE))
    args = ap.parse_args()
    base = [f"model={args.model}", "data=synthetic", *wandb_overrides("offload_step"), f"trainer.max_steps={args.steps}",
            "trainer.eval_every=0", f"trainer.micro_batch_size={args.micro_batch}", "trainer.progress_bar=false",
            "trainer.save_checkpoint=false", f"trainer.throughput_warmup_steps={args.warmup}", "trainer.log_every=1"]
    jobs = {"memopt zero2+offload": DTYPE[args.dtype], "deepspeed zero2+offload": ["engine=deepspeed", *DTYPE[args.dtype]]}
    tmp = bench_dir("offload_step")
    results: dict[str, list[dict]] = {}
    names = list(jobs)
    for rep in range(args.repeats):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            s = run_job(base + jobs[name], os.path.join(tmp, f"{rep}-{name.split()[0]}"))
            assert s["status"] == "ok", s
            results.setdefault(name, []).append(s)
            print(f"done: {name} (repeat {rep}): optim step {s['optim_step_s']:.3f} s", file=sys.stderr)
    best = {n: min(rs, key=lambda s: s["optim_step_s"]) for n, rs in results.items()}
    ds = best["deepspeed zero2+offload"]
    rows = []
    for n in names:
        s, rs = best[n], results[n]
        peaks = s["peak_bytes"]["0"]
        dev = next((k for k in peaks if k != "host"), "cpu")
        rows.append([n, f"{s['optim_step_s']:.3f} ({max(r['optim_step_s'] for r in rs):.3f})",
                     f"{s['optim_step_s'] / ds['optim_step_s']:.2f}", f"{s['step_time_s']:.2f}",
                     mib(peaks.get(dev, {}).get("total", 0)), mib(peaks.get(dev, {}).get("grads", 0)),
                     mib(peaks.get("host", {}).get("total", 0)), f"{s['final_loss']:.4f}"])
    print(machine_line())
    print(f"model={args.model} ({best[names[0]]['params'] / 1e6:.1f}M params) dtype={args.dtype} micro_batch={args.micro_batch} "
          f"steps={args.steps} repeats={args.repeats}; medians of steps {args.warmup}..{args.steps - 1}, best repeat "
          "(worst in parentheses)\n")
    print(table(["config", "optim step s (worst)", "vs deepspeed", "s/step", f"peak {dev} MiB", f"grads {dev} MiB",
                 "peak host MiB", "final loss"], rows))


if __name__ == "__main__":
    main()

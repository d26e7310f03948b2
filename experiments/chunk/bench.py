"""The chunk engine (PatrickStar) against plain memopt and DeepSpeed ZeRO-Offload, side by side.

    python experiments/chunk/bench.py [--model gpt_small] [--steps 5] [--repeats 2] [--dtype fp16|bf16|fp32]

One rank, one process, every job on the same model, data and seed, one after the other (the order
rotates between repeats; step times are the best repeat's median, the worst in parentheses):

  plain                 memopt engine, same precision (the reference)
  chunk unlimited       chunk engine, device budget unlimited, all Adam on the host (PatrickStar
                        without --use_hybrid_adam: ZeRO-Offload's placement)
  hybrid unlimited      + Hybrid Adam: optimizer chunks on the device as the margin allows
  hybrid 50% / 25%      Hybrid Adam with a device chunk budget of 50% / 25% of the model states
                        (the device budget is that plus the non-model peak measured by the
                        unlimited run's warm-up; the warm-up chunk budget is the same share)
  hybrid 12.5%          below the param+grad chunks (25% of the states in mixed precision):
                        dynamic partition still fits them where the activations are small
  static hybrid 12.5%   static partition: the chunk budget holds at every moment, so chunks are
                        evicted and fetched all through the step
  chunk 50%             all-host Adam at the 50% budget
  memopt zero-offload   memopt zero2 + cpu_offload (fp32 master and Adam on the host)
  deepspeed zero-offload  DeepSpeed ZeRO-2 + offload_optimizer (DeepSpeedCPUAdam), same precision

Precision (``--dtype``; every row the same math, so the final losses agree): fp16 on CUDA; on a
CPU bf16 weights (fp32 masters) when it has bf16 matrix instructions (AVX-512-BF16 or AMX), else
fp32, because without them bf16 and fp16 matmuls are emulated (~40x slower than fp32 on an AVX2
CPU: minutes per gpt_small step). Model states per parameter: fp16/bf16 params + grads (2 + 2 B) +
fp32 master, momentum, variance (12 B) = 16 B; in fp32 params + grads 4 + 4 B + 12 B = 20 B (the
chunk engine keeps its fp32 master chunk next to the parameter chunk; memopt's and DeepSpeed's
ZeRO-Offload keep the host master next to the device parameters too). The budget rows are cut
from these bytes, so in fp32 the param+grad chunks are 40% of the states (25% in mixed precision).
A job that fails (e.g. a budget too small for the chunks a moment needs) is reported as a row.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from experiments.common import bench_dir, cpu_has_bf16_matmul, machine_line, mib, table, wandb_overrides  # noqa: E402
from memopt.api import run_job  # noqa: E402

DTYPES = {
    "fp16": {"plain": ["+strategy=fp16"], "chunk": ["+strategy=[chunk,fp16]"], "hybrid": ["+strategy=hybrid_adam"]},
    "bf16": {"plain": ["+strategy=bf16", "strategy.bf16.params=bf16"],
             "chunk": ["+strategy=[chunk,bf16]", "strategy.bf16.params=bf16"], "hybrid": ["+strategy=hybrid_adam_bf16"]},
    "fp32": {"plain": [], "chunk": ["+strategy=chunk"], "hybrid": ["+strategy=hybrid_adam_fp32"]},
}
STATE_BYTES = {"fp16": 16, "bf16": 16, "fp32": 20}  # model-state bytes per parameter (see above)


def default_dtype(cuda: bool) -> str:
    return "fp16" if cuda else "bf16" if cpu_has_bf16_matmul() else "fp32"


def offload_strategy(dtype: str) -> list[str]:
    """zero2 + cpu_offload in ``dtype`` (fp32: no precision strategy)."""
    return ["+strategy=[zero2,cpu_offload]" if dtype == "fp32" else f"+strategy=[zero2,cpu_offload,{dtype}]"]
GiB = 2**30


def chunk_records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["chunk"] for r in map(json.loads, f) if "chunk" in r]


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="steps excluded from the median (the first is the chunk warm-up)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default=default_dtype(torch.cuda.is_available()), choices=list(DTYPES),
                    help="default: fp16 on CUDA; on a CPU bf16 with AVX-512-BF16/AMX, else fp32")
    ap.add_argument("--no-deepspeed", action="store_true")
    args = ap.parse_args()
    d = DTYPES[args.dtype]
    base = [f"model={args.model}", "data=synthetic", *wandb_overrides("chunk"), f"trainer.max_steps={args.steps}",
            "trainer.eval_every=0", f"trainer.micro_batch_size={args.micro_batch}", "trainer.progress_bar=false",
            "trainer.save_checkpoint=false", f"trainer.throughput_warmup_steps={args.warmup}", "trainer.log_every=1"]
    if args.dtype == "fp16":
        base.append("strategy.fp16.init_scale=1024")

    tmp = bench_dir("chunk")
    results: dict[str, list[tuple[dict, str]]] = {}
    failed: dict[str, str] = {}

    def run(name: str, extra: list[str], rep: int) -> tuple[dict, str]:
        rd = os.path.join(tmp, f"{rep}-{name.replace(' ', '_').replace('%', 'pct')}")
        try:
            s = run_job(base + extra, rd)
        except Exception as e:  # reported as a row: the other rows still say something
            failed[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            print(f"{name} (repeat {rep}): {failed[name]}", file=sys.stderr)
            return {}, rd
        results.setdefault(name, []).append((s, rd))
        print(f"done: {name} (repeat {rep}): {s['step_time_s']:.2f} s/step", file=sys.stderr)
        return s, rd

    # the unlimited run's warm-up measures the non-model peak and the model-state bytes the budgets are cut from
    s0, rd = run("chunk unlimited", d["chunk"], 0)
    nonmodel = chunk_records(rd)[-1]["max_nonmodel_bytes"]
    n_params = s0["params"]
    states = STATE_BYTES[args.dtype] * n_params

    def budget(frac: float) -> list[str]:
        chunk_budget = frac * states
        dev = chunk_budget + nonmodel
        return [f"strategy.chunk.device_budget_gb={dev / GiB}", f"strategy.chunk.warmup_gpu_chunk_mem_ratio={chunk_budget / dev}"]

    jobs = {
        "plain": d["plain"],
        "chunk unlimited": d["chunk"],
        "hybrid unlimited": d["hybrid"],
        "hybrid 50%": d["hybrid"] + budget(0.5),
        "hybrid 25%": d["hybrid"] + budget(0.25),
        "hybrid 12.5%": d["hybrid"] + budget(0.125),
        "static hybrid 12.5%": [d["hybrid"][0].replace("+strategy=", "+strategy=[static_partition,") + "]"] + budget(0.125),
        "chunk 50%": d["chunk"] + budget(0.5),
        "memopt zero-offload": offload_strategy(args.dtype) + d["plain"][1:],
    }
    if not args.no_deepspeed:
        jobs["deepspeed zero-offload"] = ["engine=deepspeed", *offload_strategy(args.dtype)] + d["plain"][1:]
    names = list(jobs)
    for rep in range(args.repeats):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            if rep == 0 and name == "chunk unlimited":
                continue  # ran first, above
            run(name, jobs[name], rep)

    best = {n: min(rs, key=lambda r: r[0]["step_time_s"]) for n, rs in results.items()}
    worst = {n: max(r[0]["step_time_s"] for r in rs) for n, rs in results.items()}
    ref = best["plain"][0]["step_time_s"]
    rows = []
    for n in names:
        if n not in best:
            rows.append([n, failed.get(n, "not run")] + [""] * 10)
            continue
        s, rd = best[n]
        dev = next((k for k in s["peak_bytes"]["0"] if k != "host"), "cpu")
        peaks = s["peak_bytes"]["0"]
        recs = chunk_records(rd)
        steady = recs[args.warmup:] or recs
        row = [n, f"{s['step_time_s']:.2f} ({worst[n]:.2f})", f"{s['step_time_s'] / ref:.2f}", f"{s['optim_step_s']:.3f}",
               mib(peaks.get(dev, {}).get("total", 0)), mib(peaks.get("host", {}).get("total", 0))]
        if recs:
            r = recs[-1]
            budget_b = r["device_budget_bytes"]
            limited = any(o.startswith("strategy.chunk.device_budget_gb=") for o in jobs[n])
            row += [mib(r["chunk_peak_bytes_device"]), mib(budget_b) if limited else "-",
                    f"{sum(x['mean_chunks_on_device'] for x in steady) / len(steady):.1f} / {r['chunks_total']}",
                    f"{r['optim_chunks_on_device']}", f"{(r['evictions'] - recs[0]['evictions']) / max(1, len(recs) - 1):.0f}"]
        else:
            row += ["", "", "", "", ""]
        row.append(f"{s['final_loss']:.4f}")
        rows.append(row)

    print(machine_line())
    print(f"model={args.model} ({n_params / 1e6:.1f}M params, model states {mib(states)} MiB) dtype={args.dtype} "
          f"micro_batch={args.micro_batch} steps={args.steps} repeats={args.repeats}; non-model peak {mib(nonmodel)} MiB; "
          f"step time: median of steps {args.warmup}..{args.steps - 1}, best repeat (worst in parentheses)\n")
    print(table(["config", "s/step (worst)", "vs plain", "optim step s", f"peak {dev} MiB", "peak host MiB", "chunk peak dev MiB",
                 "device budget MiB", "mean chunks on dev", "optim chunks on dev", "evictions/step", "final loss"], rows))


if __name__ == "__main__":
    main()

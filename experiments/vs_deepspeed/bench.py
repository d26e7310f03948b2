"""memopt against DeepSpeed (and FSDP2 where it applies) on the same model, data, loop and tracker.

    python experiments/vs_deepspeed/bench.py [--steps 6] [--micro-batch 4] [--model gpt_small] [--dtype fp32]

Matrix: {zero1, zero2, zero3, zero2+cpu_offload, zero3+cpu_offload} x {memopt, deepspeed, fsdp2};
fsdp2 only where it has an equivalent (zero2, zero3; no zero1, and no cpu_offload on a CPU-only
machine). All jobs run in ONE launch of 2 local ranks (gloo on CPU), one after the other, engines
alternating within each configuration (the first engine rotates between configurations so none is
always first). Every job uses ``data=synthetic`` and the same seed, micro-batch, dtype, optimizer
math, clipping, bucket sizes and overlap (see README.md for the fairness rules).

Printed per configuration: median tokens/s after ``--warmup`` steps (best of ``--repeats`` runs of
the matrix, worst in parentheses), peak tracked bytes per rank on
the compute device and on the host (offload), the ratios memopt/deepspeed, and a per-category
breakdown of rank 0's peaks (what each engine holds).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from experiments.common import bench_dir, machine_line, mib, table, wandb_overrides  # noqa: E402
from memopt.api import run_jobs_on_ranks  # noqa: E402

CONFIGS = {c: c.split("+") for c in ("zero1", "zero2", "zero3", "zero2+cpu_offload", "zero3+cpu_offload")}
DTYPES = {"fp32": ([], []), "bf16": (["bf16"], ["strategy.bf16.params=bf16"])}  # strategies, options
CATS = ("params", "grads", "optim", "activations", "temp", "other")


def applies(engine: str, config: str, cuda: bool) -> bool:
    if engine != "fsdp2":
        return True
    return config != "zero1" and ("cpu_offload" not in config or cuda)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="steps excluded from the median tokens/s")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    ap.add_argument("--engines", default="memopt,deepspeed,fsdp2")
    ap.add_argument("--with", dest="extra", default="",
                    help="strategies added to every job on every engine, e.g. ckpt (comma-separated)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--repeats", type=int, default=2,
                    help="run the matrix this many times (engine order rotated each time); tokens/s is the best "
                         "repeat, which filters out other processes on a shared machine (peaks are deterministic)")
    args = ap.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    engines = args.engines.split(",")
    configs = args.configs.split(",")
    base = [f"model={args.model}", "data=synthetic", *wandb_overrides("vs_deepspeed"), f"trainer.max_steps={args.steps}",
            "trainer.eval_every=0", f"trainer.micro_batch_size={args.micro_batch}", "trainer.progress_bar=false",
            "trainer.save_checkpoint=false", f"trainer.throughput_warmup_steps={args.warmup}",
            f"trainer.log_every={args.steps}"]
    keys, jobs = [], []
    load0 = os.getloadavg()[0]
    tmp = bench_dir("vs_deepspeed")
    for rep in range(args.repeats):
        for i, config in enumerate(configs):
            k = (i + rep) % len(engines)
            order = engines[k:] + engines[:k]  # rotate who goes first, per configuration and repeat
            for engine in order:
                if not applies(engine, config, cuda):
                    continue
                strategies = CONFIGS[config] + DTYPES[args.dtype][0] + [x for x in args.extra.split(",") if x]
                over = [f"+strategy=[{','.join(strategies)}]", *DTYPES[args.dtype][1]]
                keys.append((config, engine))
                jobs.append((base + [f"engine={engine}"] + over, os.path.join(tmp, f"{rep}-{config}-{engine}")))
    print(f"running {len(jobs)} jobs on 2 ranks ...", file=sys.stderr)
    results = run_jobs_on_ranks(2, jobs)
    load1 = os.getloadavg()[0]
    summaries, spread = {}, {}
    for key, s in zip(keys, results):
        spread.setdefault(key, []).append(s["tokens_per_s"])
        if key not in summaries or s["tokens_per_s"] > summaries[key]["tokens_per_s"]:
            summaries[key] = s

    dev = "cuda:0" if cuda else "cpu"

    def peak(s, rank, device):
        return (s.get("peak_bytes") or {}).get(str(rank), {}).get(device, {}).get("total", 0)

    rows, cats = [], []
    for config in configs:
        res = {e: summaries.get((config, e)) for e in engines}
        for e in engines:
            s = res[e]
            if s is None:
                continue
            d = [peak(s, r, dev) for r in (0, 1)]
            h = [peak(s, r, "host") for r in (0, 1)]
            row = [config, e, f"{s['tokens_per_s']:,.0f} ({min(spread[(config, e)]):,.0f})", f"{mib(d[0])} / {mib(d[1])}", f"{mib(h[0])} / {mib(h[1])}",
                   f"{s['final_loss']:.4f}"]
            ds = res.get("deepspeed")
            if e == "memopt" and ds is not None:
                dd, dh = max(peak(ds, r, dev) for r in (0, 1)), max(peak(ds, r, "host") for r in (0, 1))
                row += [f"{s['tokens_per_s'] / ds['tokens_per_s']:.2f}", f"{max(d) / dd:.2f}" if dd else "-",
                        f"{(max(d) + max(h)) / (dd + dh):.2f}" if dd + dh else "-"]
            else:
                row += ["", "", ""]
            rows.append(row)
            p0 = s["peak_bytes"]["0"]
            cats.append([config, e] + [mib(p0.get(dev, {}).get(c, 0)) for c in CATS] + [mib(p0.get("host", {}).get("optim", 0))])
    print(machine_line())
    print(f"model={args.model} dtype={args.dtype} with={args.extra or '-'} micro_batch={args.micro_batch} ranks=2 steps={args.steps} "
          f"repeats={args.repeats}; tokens/s: median over steps {args.warmup}..{args.steps - 1}, best repeat "
          f"(worst in parentheses); 1-min load average {load0:.1f} at start, {load1:.1f} at end\n")
    print(table(["config", "engine", "tokens/s (worst)", f"peak {dev} MiB r0 / r1", "peak host MiB r0 / r1", "final loss",
                 "memopt/ds tok/s", f"memopt/ds peak {dev}", "memopt/ds peak dev+host"], rows))
    # (no RSS column: every job of the launch runs in the same rank processes, so ru_maxrss only grows)
    print(f"\nrank 0 peak MiB by category ({dev}; each category's own peak; host optim):\n")
    print(table(["config", "engine"] + list(CATS) + ["host optim"], cats))


if __name__ == "__main__":
    main()

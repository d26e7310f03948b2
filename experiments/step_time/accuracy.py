"""The planner's step time against the measured one: every composition that runs on this CPU, 2 ranks.

    python experiments/step_time/accuracy.py                 # the matrix (~5 min a repeat on 2 AVX2 cores)
    python experiments/step_time/accuracy.py --only ddp,zero3 --steps 3
    python experiments/step_time/accuracy.py --adjacent      # each row planned right before its run

Each model's rows are planned in a fresh process of their own (``make_plan``, ``hardware=auto`` resolved there
and completed by ``planner/cpu_rates/``, as a plan-mode command plans them: ``planned_as_the_cli``) and each
row trained in a launch of 2 ranks of its own; measured = the median step after ``--warmup`` steps, best of
``--repeats``. Printed: the plan's terms, planned / measured, whether it is within 25% (issue #30's goal), and
Spearman's rank correlation of planned against measured order (what ``+strategy=auto`` ranks by).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from experiments.common import bench_dir, machine_line, planned_step_time, spearman, table  # noqa: E402

SMALL = ["model=gpt_small", "model.seq_len=256", "trainer.micro_batch_size=2"]
TINY = ["model=gpt_tiny", "trainer.micro_batch_size=8"]
MOE = ["model=moe_tiny", "trainer.micro_batch_size=8"]
# name -> overrides (model, strategies, options): the compositions that run on a CPU with 2 gloo ranks
ROWS = {
    "ddp": [*SMALL, "+strategy=[ddp]"],
    "zero1": [*SMALL, "+strategy=[zero1]"],
    "zero2": [*SMALL, "+strategy=[zero2]"],
    "zero3": [*SMALL, "+strategy=[zero3]"],
    "zero2+cpu_offload": [*SMALL, "+strategy=[zero2,cpu_offload]"],
    "zero3+cpu_offload": [*SMALL, "+strategy=[zero3,cpu_offload]"],
    "ddp+ckpt": [*SMALL, "+strategy=[ddp,ckpt]"],
    "zero3+ckpt selective": [*SMALL, "+strategy=[zero3,ckpt]", "strategy.ckpt.policy=selective"],
    "ddp, micro-batch 1 x 2": [*SMALL, "+strategy=[ddp]", "trainer.micro_batch_size=1", "trainer.grad_accum=2"],
    "tp=2": [*SMALL, "+strategy=[tp]", "parallel.tp=2", "trainer.grad_accum=2"],
    "tp=2 + sequence parallel": [*SMALL, "+strategy=[tp]", "parallel.tp=2", "strategy.tp.sequence_parallel=true",
                                 "trainer.grad_accum=2"],
    "chunk (host Adam)": [*SMALL, "+strategy=[chunk]"],
    "ckpt+act_offload": [*SMALL, "+strategy=[ddp,ckpt,act_offload]"],
    "gpt_tiny ddp": [*TINY, "+strategy=[ddp]"],
    "gpt_tiny zero3": [*TINY, "+strategy=[zero3]"],
    "moe_tiny ddp": [*MOE, "+strategy=[ddp]"],
    "moe_tiny ep=2": [*MOE, "+strategy=[zero2]", "parallel.ep=2"],
    # DeepSpeed's own paths (planner/engines/deepspeed: its reductions, ZeRO-3 fetches, DeepSpeed-MoE groups, step)
    "deepspeed ddp": [*SMALL, "engine=deepspeed", "+strategy=[ddp]"],
    "deepspeed zero3": [*SMALL, "engine=deepspeed", "+strategy=[zero3]"],
    "deepspeed zero3+cpu_offload": [*SMALL, "engine=deepspeed", "+strategy=[zero3,cpu_offload]"],
    "deepspeed moe_tiny ep=2": [*MOE, "engine=deepspeed", "+strategy=[zero2]", "parallel.ep=2"],
}
# the fixed-budget table's shapes (experiments/fixed_budget): gpt_small at its own sequence of 512, micro-batches of 4-16,
# where the attention's share of the step is twice the 256-token rows' (its own rate: hardware.attention_efficiency)
WIDE = ["model=gpt_small"]
MOE_SMALL = ["strategy.moe.num_experts=8", "strategy.moe.every_k_layers=2"]  # its preset's (+strategy=moe resets them)
BF16_WIDE = {
    "bf16 ddp 16 x 1 seq 512": [*WIDE, "+strategy=[bf16,ddp]", "trainer.micro_batch_size=16"],
    "hybrid_adam_bf16 16 x 1 seq 512": [*WIDE, "+strategy=[hybrid_adam_bf16]", "trainer.micro_batch_size=16"],
    "hybrid_adam_bf16 4 x 4 seq 512": [*WIDE, "+strategy=[hybrid_adam_bf16]", "trainer.micro_batch_size=4",
                                        "trainer.grad_accum=4"],
    "deepspeed bf16 zero2 8 x 2 seq 512": [*WIDE, "engine=deepspeed", "+strategy=[bf16,zero2]",
                                            "trainer.micro_batch_size=8", "trainer.grad_accum=2"],
    "deepspeed bf16 zero2+cpu_offload 4 x 4 seq 512": [*WIDE, "engine=deepspeed", "+strategy=[bf16,zero2,cpu_offload]",
                                                       "trainer.micro_batch_size=4", "trainer.grad_accum=4"],
    # the fixed-budget table's moe_small at 50% of DDP's peak: memopt's search ranked the first ahead, runs the second faster
    "moe_small hybrid_adam_bf16 16 x 1": ["model=moe_small", "+strategy=[moe,hybrid_adam_bf16]", *MOE_SMALL,
                                          "trainer.micro_batch_size=16"],
    "moe_small bf16 ddp ep=2 8 x 2": ["model=moe_small", "+strategy=[moe,bf16,ddp]", *MOE_SMALL, "parallel.ep=2",
                                      "trainer.micro_batch_size=8", "trainer.grad_accum=2"],
    # and at 100%: memopt's search (AMX CPU, 2026-11-28) ranked the chunk engine with ep=2 ahead of DDP with ep=2
    "moe_small hybrid_adam_bf16 ep=2 16 x 1": ["model=moe_small", "+strategy=[moe,hybrid_adam_bf16]", *MOE_SMALL,
                                               "parallel.ep=2", "trainer.micro_batch_size=16"],
    "moe_small bf16 ddp ep=2 16 x 1": ["model=moe_small", "+strategy=[moe,bf16,ddp]", *MOE_SMALL, "parallel.ep=2",
                                       "trainer.micro_batch_size=16"],
}
BF16 = {"bf16 ddp": [*SMALL, "+strategy=[bf16,ddp]"], "bf16 zero2+cpu_offload": [*SMALL, "+strategy=[bf16,zero2,cpu_offload]"],
        "hybrid_adam_bf16": [*SMALL, "+strategy=[hybrid_adam_bf16]"]}


def planned_as_the_cli(rows: dict[str, list[str]]) -> dict[str, dict]:
    """Each model's rows planned in a fresh process of their own, one after another, as a plan-mode command plans
    them: this CPU's rates are probed for that model in a process that allocated nothing else before. Planned in
    one process, the tiny models' rows read their memory rate after gpt_small's probe had freed 32 MB tensors
    (glibc then serves their 1 MB activations from its heap, not fresh pages): their memory term a third of
    what their own command plans (README, 2026-11-27)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    models: dict[str, list[str]] = {}
    for k, v in rows.items():
        models.setdefault(next(o for o in v if o.startswith("model=")), []).append(k)
    plans = {}
    for keys in models.values():
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            plans.update(zip(keys, pool.map(planned_step_time, [rows[k] for k in keys])))
    return plans


def main() -> None:
    from experiments.common import cpu_has_bf16_matmul
    from memopt.api import run_jobs_on_ranks

    ap = argparse.ArgumentParser()
    # 8 steps, the median of the last 5: with 4 (the median of 2) an AVX2 CPU's tiny rows read 20-40% slow
    # (moe_tiny ep=2 0.341 s against 0.240 over 12 steps), the early steps' one-time costs in the median
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated row names")
    ap.add_argument("--adjacent", action="store_true",
                    help="plan each row in a fresh process right before each of its runs, as +strategy=auto plans and then "
                         "trains: the CPU's rates read in the same minute as the run they predict (a shared machine's "
                         "speed moves by tens of percent between minutes); the row's plan is its fastest run's")
    args = ap.parse_args()
    rows = dict(ROWS, **(dict(BF16, **BF16_WIDE) if cpu_has_bf16_matmul() else {}))
    if args.only:
        rows = {k: v for k, v in rows.items() if k in args.only.split(",")}
    base = ["data=synthetic", "logger=none", f"trainer.max_steps={args.steps}", "trainer.eval_every=0",
            "trainer.progress_bar=false", "trainer.save_checkpoint=false", f"trainer.throughput_warmup_steps={args.warmup}",
            f"trainer.log_every={args.steps}"]
    plans = {} if args.adjacent else planned_as_the_cli({k: [*base, *v] for k, v in rows.items()})
    tmp = bench_dir("step_time")
    keys, jobs = [], []
    for rep in range(args.repeats):
        for k, v in rows.items():
            keys.append(k)
            jobs.append(([*base, *v], os.path.join(tmp, f"{rep}-{k.replace(' ', '_').replace('=', '')}")))
    load0 = os.getloadavg()[0]
    results, job_plans = [], []
    for k, job in zip(keys, jobs):  # a launch each: nothing left by one job slows the next
        if args.adjacent:
            job_plans.append(planned_as_the_cli({k: job[0]})[k])
        results.append(run_jobs_on_ranks(2, [job])[0])
    load1 = os.getloadavg()[0]
    measured: dict[str, float] = {}
    for i, (k, s) in enumerate(zip(keys, results)):
        if s.get("step_time_s") is not None and s["step_time_s"] < measured.get(k, float("inf")):
            measured[k] = s["step_time_s"]  # (a failed run leaves its row unmeasured, not the matrix lost)
            if args.adjacent:
                plans[k] = job_plans[i]
    for k in rows:
        if k not in plans:  # adjacent, every run failed: the first plan made for it
            plans[k] = job_plans[keys.index(k)]
    out, p_list, m_list = [], [], []
    for k in rows:
        st, m = plans[k], measured.get(k)
        if m is None:
            out.append([k, "-", "-", "not measured (the run failed)", "-", "NO"])
            continue
        p = st["total_s"]
        terms = " + ".join(f"{n[:-2]} {st[n]:.3g}" for n in ("compute_s", "memory_s", "overhead_s", "offload_s", "comm_s",
                                                               "optimizer_s") if st.get(n))
        ratio = p / m if p else None
        out.append([k, f"{p:.3g}" if p else "-", terms, f"{m:.3g}", f"{ratio:.2f}" if ratio else "-",
                    "yes" if ratio and 0.75 <= ratio <= 1.25 else "NO"])
        if p:
            p_list.append(p)
            m_list.append(m)
    print(machine_line())
    print(f"2 ranks, steps={args.steps}, median after {args.warmup}, best of {args.repeats}"
          f"{', each planned right before its run' if args.adjacent else ''}; 1-min load average "
          f"{load0:.1f} at start, {load1:.1f} at end\n")
    print(table(["composition", "planned s", "planned terms (s)", "measured s", "planned/measured", "within 25%"], out))
    within = sum(r[-1] == "yes" for r in out)
    print(f"\nwithin 25%: {within} of {len(out)}; Spearman rank correlation planned vs measured: "
          f"{spearman(p_list, m_list):.3f}")


if __name__ == "__main__":
    main()

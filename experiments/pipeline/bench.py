"""Pipeline parallelism against data and tensor parallelism on 2 ranks, the same model and global batch
(fp32, gloo on CPU, one thread per rank).

    python experiments/pipeline/bench.py [--model gpt_small] [--steps 4] [--micro-batch 2] [--micro-batches 4]
                                         [--seq-len 256] [--four]

One launch of 2 ranks runs, one after the other: dp=2 (ddp, each rank half of the micro-batches), tp=2
(both ranks see every micro-batch), and pp=2 with GPipe, 1F1B and interleaved 1F1B (2 virtual stages
per rank), DeepSpeed's pipeline engine (engine=deepspeed, its 1F1B), and 1F1B with the planner's
balanced split (``strategy.pipeline.split=balanced``, resolved before the launch; a second table puts
its planned stage peaks and the even split's beside the measured ones); every job processes
micro-batch x micro-batches x seq tokens per step. ``--four`` adds a
launch of 4 ranks: pp=2 x dp=2 (the 2 cores are then oversubscribed: its times are not comparable,
its bytes are).

Per rank: the peak total and activation bytes (the tracker), the measured idle share of the pipeline's
schedule (1 - the seconds its stages compute / the schedule's seconds, mean over the steps after the
first) beside the formula (pp - 1) / (v m + pp - 1), the bytes rank 0 sends per step (its step 0:
activations forward, and on the last stage gradients back), tokens/s and the step time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from experiments.common import bench_dir, machine_line, table  # noqa: E402
from memopt.api import run_jobs_on_ranks  # noqa: E402

PP = ["+strategy=pipeline", "parallel.pp=2"]


def configs(m: int) -> dict[str, list[str]]:
    """name -> overrides; ``m`` micro-batches per step for one pipeline (dp=2: m/2 per rank)."""
    return {
        "dp=2 (ddp)": ["+strategy=ddp", f"trainer.grad_accum={m // 2}"],
        "tp=2": ["+strategy=tp", "parallel.tp=2", f"trainer.grad_accum={m}"],
        "pp=2 gpipe": [*PP, "strategy.pipeline.schedule=gpipe", f"trainer.grad_accum={m}"],
        "pp=2 1f1b": [*PP, "strategy.pipeline.schedule=1f1b", f"trainer.grad_accum={m}"],
        "pp=2 interleaved v=2": [*PP, "strategy.pipeline.schedule=interleaved_1f1b", f"trainer.grad_accum={m}"],
        "pp=2 1f1b deepspeed": ["engine=deepspeed", *PP, "strategy.pipeline.schedule=1f1b", f"trainer.grad_accum={m}"],
    }


def balanced(base: list[str], m: int) -> tuple[str, list[str], dict]:
    """The 1F1B job with the planner's balanced split (resolved here, so the row can name it and its plan)."""
    from memopt.config import compose_config, to_dataclass
    from memopt.planner.balance import balanced_split

    over = [*PP, "strategy.pipeline.schedule=1f1b", f"trainer.grad_accum={m}"]
    got = balanced_split(to_dataclass(compose_config([*base, *over, "trainer.nproc_per_node=2",
                                                      "strategy.pipeline.split=balanced"])))
    split = got["split"]
    return f"pp=2 1f1b balanced {split}", [*over, f"strategy.pipeline.split=[{','.join(map(str, split))}]"], got


def idle(run_dir: str) -> tuple[list[float], float | None]:
    """Mean measured idle share per pipeline rank over the steps after the first, and the formula."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line).get("pipeline") for line in f]
    recs = [r for r in recs if r]
    if not recs:
        return [], None
    steady = recs[1:] or recs
    return [statistics.mean(r["idle"][i] for r in steady) for i in range(len(steady[0]["idle"]))], recs[0]["formula"]


def row(name: str, s: dict, run_dir: str) -> list:
    ranks = sorted(s["peak_bytes"], key=int)
    peaks = [s["peak_bytes"][r]["cpu"] for r in ranks]
    got, formula = idle(run_dir)
    ops = s.get("comm_per_step", {}).get("ops", {})
    return [name,
            " / ".join(f"{p['total'] / 2**20:.0f}" for p in peaks),
            " / ".join(f"{p['activations'] / 2**20:.0f}" for p in peaks),
            " / ".join(f"{v:.2f}" for v in got) or "-", f"{formula:.2f}" if formula is not None else "-",
            f"{ops.get('send', {}).get('bytes', 0) / 2**20:.1f}",
            f"{sum(v['bytes'] for k, v in ops.items() if k not in ('send', 'recv')) / 2**20:.1f}",
            f"{s['tokens_per_s']:,.0f}", f"{s['step_time_s']:.2f}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--four", action="store_true", help="also pp=2 x dp=2 on 4 ranks")
    args = ap.parse_args()
    base = [f"model={args.model}", f"model.seq_len={args.seq_len}", "data=synthetic", "logger=none",
            f"trainer.max_steps={args.steps}", "trainer.eval_every=0", f"trainer.micro_batch_size={args.micro_batch}",
            "trainer.progress_bar=false", "trainer.save_checkpoint=false", "trainer.throughput_warmup_steps=1",
            "trainer.count_comm=true", "trainer.num_threads=1", "trainer.log_every=1"]
    out = bench_dir("pipeline")
    cases = configs(args.micro_batches)
    name, over, plan = balanced(base, args.micro_batches)
    cases[name] = over
    jobs = {n: (base + o, os.path.join(out, f"job{i}")) for i, (n, o) in enumerate(cases.items())}
    summaries = dict(zip(jobs, run_jobs_on_ranks(2, list(jobs.values()))))
    rows = [row(n, summaries[n], jobs[n][1]) for n in jobs]
    if args.four:
        d = os.path.join(out, "pp2xdp2")
        (s,) = run_jobs_on_ranks(4, [(base + PP + [f"trainer.grad_accum={args.micro_batches // 2}"], d)])
        rows.append(row("pp=2 x dp=2 (4 ranks, 1f1b)", s, d))
    print(machine_line())
    print(f"model={args.model} seq_len={args.seq_len} micro_batch={args.micro_batch} x {args.micro_batches} "
          f"micro-batches per step (one pipeline; dp=2: half per rank), steps={args.steps}, fp32, gloo, "
          "1 thread per rank")
    print(table(["config", "peak MiB per rank", "activations MiB per rank", "idle measured per rank",
                 "bubble formula", "sent p2p MiB/step (rank 0)", "collectives MiB/step (rank 0)", "tokens/s", "step s"],
                rows))
    mib = lambda xs: " / ".join(f"{x / 2**20:.0f}" for x in xs)  # noqa: E731
    measured = lambda n: [summaries[n]["peak_bytes"][r]["cpu"]["total"] for r in ("0", "1")]  # noqa: E731
    print(table(["1f1b split", "planned peak MiB per stage", "measured peak MiB per stage"],
                [[f"even {plan['even']}", mib(plan["even_peaks"]), mib(measured("pp=2 1f1b"))],
                 [f"balanced {plan['split']}", mib(plan["peaks"]), mib(measured(name))]]))


if __name__ == "__main__":
    main()

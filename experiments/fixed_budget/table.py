"""Issue #30's table: at a fixed device budget per rank, memopt's choice against DeepSpeed's and FSDP2's.

    python experiments/fixed_budget/table.py                       # gpt_small and moe_small, 4 budgets (hours)
    python experiments/fixed_budget/table.py --models gpt_small --budgets 0.25 --steps 4 --repeats 1
    python experiments/fixed_budget/table.py --planned-only        # the planned node tables (minutes)

Measured part (2 ranks of this CPU): the budget B = a fraction of plain fp32 DDP's measured device peak per rank
(the model's own DDP run, 2 steps). At each budget, four rows: ``+strategy=auto`` under engine=memopt,
engine=deepspeed and engine=fsdp2 (each search run through the CLI in plan mode, ``auto.json``'s winner
taken; with ``--trials k`` every engine's search trains its k fastest predicted candidates a few steps and takes
the fastest by plan and trial, ``strategy.auto.trials``), and what a DeepSpeed user types without a planner (ZeRO-3 with optimizer and parameter offload and
activation checkpointing, fp32), and below 100% memopt's own best, its choice at 100% (the goal there is a fraction
of it: running it beside the budget's rows keeps that ratio out of the VM's slow and fast phases). All chosen runs then train, the budget held by the
tracker (``hardware.device_memory_gb=B``: a run that crosses it ends ``oom`` at that op), engines alternating,
the first rotating per repeat; tokens/s (and MFU, step time) is each run's median step after the warm-up, the
median over the repeats (worst in parentheses). Each row's planned step time twice: its search's (every search of
the launch ranks by one reading of the CPU's rates, the first search's: ``hardware.rates_file``), and every row
planned again in one process after the runs (a second reading; Spearman of that order against the measured one over
all of a budget's measured rows, ``planned_in_one_process``). Same model, data, seed, optimizer math, clipping and global batch on every row (the search keeps
the global batch: micro-batch x accumulation).

Planned part (``--planned-only`` or after the measured one): the same three searches for gpt_1b and gpt_10b on
a node of 8 A100 80G and on PatrickStar's node (8 V100 32 GB, 240 GB host), planned, not run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from experiments.common import (REPO, bench_dir, machine_line, mib, planned_step_time, spearman, table,  # noqa: E402
                                widest_misordered_pair)

ENGINES = ("memopt", "deepspeed", "fsdp2")
TYPED = ["engine=deepspeed", "+strategy=[zero3,cpu_offload,ckpt]"]  # a DeepSpeed user's ZeRO-3-Offload, no planner
# DeepSpeed runs MoE with ZeRO stage 2 at most (it asserts so): for a MoE model its user's ZeRO-Offload is stage 2
TYPED_MOE = ["engine=deepspeed", "+strategy=[zero2,cpu_offload,ckpt]"]  # (the model preset selects moe)
COMMON = ["logger=none", "trainer.progress_bar=false", "trainer.eval_every=0", "trainer.save_checkpoint=false",
          "data=synthetic"]
NODES = {"8x A100 80G": ["hardware=a100_80g", "trainer.nproc_per_node=8"],
         "PatrickStar's node (8x V100 32 GB, 240 GB host)": ["hardware=v100_patrickstar", "trainer.nproc_per_node=8"]}
NODE_KEYS = dict(zip(NODES, ("a100", "v100")))
OWN = "memopt at 100%"  # memopt's own best (its choice at 100% of DDP's peak), run beside each budget under 100%


def cli(args: list[str], run_dir: str) -> dict | None:
    """``python -m memopt.train ARGS`` in a process of its own; its summary.json (None when it wrote none, its
    last line printed)."""
    p = subprocess.run([sys.executable, "-m", "memopt.train", *args, f"hydra.run.dir={run_dir}", "trainer.overwrite=true"],
                       cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            return json.load(f)
    except OSError:
        print(f"no summary.json from {' '.join(args)}: {(p.stderr.strip().splitlines() or [''])[-1]}", file=sys.stderr)
        return None


def choice(base: list[str], engine: str, run_dir: str, rates_file: str | None = None) -> tuple[list[str] | None, dict]:
    """The winner of ``engine``'s +strategy=auto at ``base`` (its overrides), and its ranked row. ``rates_file``: the
    CPU's step-time rates the launch's searches share (``hardware.rates_file``: the first measures, the rest read)."""
    shared = [f"hardware.rates_file={rates_file}"] if rates_file else []
    summary = cli([*base, *shared, f"engine={engine}", "+strategy=auto", "trainer.mode=plan"], run_dir)
    try:
        with open(os.path.join(run_dir, "auto.json")) as f:
            rows = json.load(f)
    except OSError:
        return None, {"why": (summary or {}).get("error", "the search wrote no auto.json")}
    if not rows or not rows[0]["fits"] or (summary or {}).get("status") == "refused":  # every trial failed, too
        return None, {"why": (summary or {}).get("error", "no candidate fits")}
    return [f"engine={engine}", *rows[0]["overrides"]], rows[0]


def own_ratio_line(frac: float, chosen: list[dict], own: list[dict]) -> str:
    """The goal below 100%: memopt's choice at the budget over its own best without one, from the runs of the same
    repeats (each pair alternating in one rotation), the median of the pairs' ratios and each pair's."""
    pairs = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(chosen, own)
             if a.get("status") == "ok" and b.get("status") == "ok"]
    if not pairs:
        return f"budget {frac:.3g}: memopt's choice / its own best (at 100%): no pair of runs that both ended ok"
    return (f"budget {frac:.3g}: memopt's choice / its own best (at 100%), pairs of one rotation: "
            f"{statistics.median(pairs):.2f}x (" + ", ".join(f"{r:.2f}x" for r in pairs) + ")")


def planned_in_one_process(rows: dict) -> dict:
    """Each row's composition (its overrides) planned again, every one in one fresh process: one reading of this
    CPU's rates for all of them, taken after the runs. Why: the searches share the launch's first reading, and a
    shared machine's rates move between minutes (gpt_small's Hybrid Adam at 8 x 2 planned 6.29 s in one search and
    8.13 in another an hour later, each probing its own), so a second reading shows whether the order holds on it;
    the typed DeepSpeed row, which no search plans, is ordered here only."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:  # one worker: one probe
            return dict(zip(rows, pool.map(_step_time_or_none, rows.values())))
    except Exception as e:  # noqa: BLE001 - its process died: the measured table is still printed, without them
        print(f"planning the rows again in one process failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return {}


def _step_time_or_none(overrides: list[str]) -> dict | None:
    """A row's planned step time, or None where planning it failed (said, and the table still printed)."""
    try:
        return planned_step_time(overrides)
    except Exception as e:  # noqa: BLE001 - one row's plan, not the measured table
        print(f"planning {' '.join(overrides)} again failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return None


def budget_gb(frac: float, peak: int) -> float:
    """``frac`` of ``peak`` bytes in GiB, rounded up to the 6 decimals the command passes: at 100% plain DDP's own
    peak is within its budget (rounded down, the budget was a few hundred bytes under the peak DDP is planned at to
    the byte, and memopt's search found its DDP over: 2026-11-28, README)."""
    return math.ceil(frac * peak / 2**30 * 1e6) / 1e6


def ddp_peak(model: str, tmp: str, extra: list[str]) -> int:
    from memopt.api import run_jobs_on_ranks

    s = run_jobs_on_ranks(2, [([f"model={model}", *COMMON, *extra, "+strategy=ddp", "trainer.max_steps=2"],
                               os.path.join(tmp, f"ddp-{model}"))])[0]
    return max(v["cpu"]["total"] for v in s["peak_bytes"].values())


def measured(args, tmp: str) -> None:
    for model in args.models.split(","):
        peak = ddp_peak(model, tmp, [o for o in args.extra.split() if not o.startswith("strategy.")])
        print(f"\n## {model}: plain fp32 DDP peaks at {mib(peak)} MiB per rank\n", flush=True)
        rows, jobs, keys = {}, [], []
        fracs = [float(b) for b in args.budgets.split(",")]
        unbudgeted = [f"model={model}", *COMMON, *args.extra.split(), "trainer.nproc_per_node=2",
                      f"trainer.max_steps={args.steps}", f"trainer.throughput_warmup_steps={args.warmup}",
                      *([f"strategy.auto.trials={args.trials}"] if args.trials else [])]  # each engine's search alike
        # the goal at a budget under 100% is a fraction of memopt's own best without one, in the same precision: its
        # choice at 100% of DDP's peak (a CPU without a device budget is one memory, where the search keeps to fp32;
        # no composition of the search needs more than fp32 DDP), run beside the budget's rows, alternating with
        # them, so that the ratio is not one of two VM phases tens of minutes apart
        full = [*unbudgeted, f"hardware.device_memory_gb={budget_gb(1.0, peak):.6f}"]
        rates = os.path.join(tmp, "cpu_rates.json")  # every search of the launch ranks by one reading of the CPU
        own = choice(full, "memopt", os.path.join(tmp, f"auto-{model}-own-memopt"), rates) if min(fracs) < 1 else None
        for frac in fracs:
            budget = budget_gb(frac, peak)
            base = [*unbudgeted, f"hardware.device_memory_gb={budget:.6f}"]
            for engine in ENGINES:
                if frac == 1 and engine == "memopt" and own is not None:  # that search is the one above
                    rows[(frac, "memopt auto")] = own
                    continue
                ov, row = choice(base, engine, os.path.join(tmp, f"auto-{model}-{frac}-{engine}"), rates)
                rows[(frac, f"{engine} auto")] = (ov, row)
            rows[(frac, "DeepSpeed typed")] = (TYPED_MOE if model.startswith("moe") else TYPED, {})
            if frac < 1 and own is not None:
                rows[(frac, OWN)] = own
            for rep in range(args.repeats):
                names = [n for (f, n) in rows if f == frac]
                names = names[rep % len(names):] + names[:rep % len(names)]  # rotate who goes first
                for name in names:
                    ov, _ = rows[(frac, name)]
                    if ov is not None:
                        keys.append((frac, name))
                        run = [o for o in (full if name == OWN else base)
                               if not o.startswith("strategy.auto.")]  # the search's own options
                        jobs.append(([*run, *ov], os.path.join(tmp, f"run-{model}-{frac}-{''.join(ch if ch.isalnum() else '_' for ch in name)}-{rep}")))
        best: dict = {}
        for key, (ov, run_dir) in zip(keys, jobs):  # each through the CLI, as a user runs it (an oom ends that run only)
            best.setdefault(key, []).append(cli(ov, run_dir) or {"status": "no summary"})
        again = planned_in_one_process(dict(zip(keys, (ov for ov, _ in jobs))))  # (a row's repeats: one composition)
        out, order, order_again = [], {}, {}
        for (frac, name), (ov, row) in rows.items():
            budget = budget_gb(frac, peak) * 2**30
            runs = best.get((frac, name), [])
            if ov is None:
                out.append([f"{frac:.3g} ({mib(budget)})", name, f"none fits: {row.get('why', '')[:80]}", "-", "-", "-", "-", "-", "-"])
                continue
            ok = [s for s in runs if s.get("status") == "ok"]
            top = ok[0] if ok else (runs[0] if runs else {})
            dev = max((v.get("cpu", {}).get("total", 0) for s in (ok or [top]) for v in (s.get("peak_bytes") or {}).values()),
                      default=0)
            planned = row.get("step_s")
            med = {k: statistics.median(s[k] for s in ok) for k in ("tokens_per_s", "step_time_s")} if ok else {}
            mfu = [s["mfu"] for s in ok if s.get("mfu") is not None]
            if ok and planned and name != OWN:
                order.setdefault(frac, []).append((planned, med["step_time_s"]))
            planned_again = (again.get((frac, name)) or {}).get("total_s")
            if ok and planned_again:
                order_again.setdefault(frac, []).append((planned_again, med["step_time_s"]))
            held = "(100%)" if name == OWN else f"{'<=' if dev <= budget else 'OVER'} budget"
            out.append([f"{frac:.3g} ({mib(budget)})", name, " ".join(o for o in ov if not o.startswith("parallel.tp=1")),
                        f"{mib(dev)} {held}" if top.get("peak_bytes") else "-",
                        f"{med['tokens_per_s']:,.0f} ({min(s['tokens_per_s'] for s in ok):,.0f})" if ok else top.get("status", "-"),
                        f"{statistics.median(mfu) * 100:.1f}%" if mfu else "-",
                        f"{top['final_loss']:.4f}" if ok else "-",
                        f"{planned:.3g} / {med['step_time_s']:.3g}" if ok and planned else "-",
                        f"{planned_again:.3g} / {med['step_time_s']:.3g}" if ok and planned_again else "-"])
        print(table(["budget (of DDP's peak)", "row", "composition", "measured peak per rank", "tokens/s median (worst)", "MFU",
                     f"loss after {args.steps} steps", "planned (its search) / measured step s",
                     "planned (one process) / measured"], out), flush=True)
        for frac in fracs:
            if (frac, OWN) in best and (frac, "memopt auto") in best:
                print(own_ratio_line(frac, best[(frac, "memopt auto")], best[(frac, OWN)]), flush=True)
        for frac, pairs in order.items():  # the searches' own plans: one reading of the rates, the launch's first
            rho = spearman([p for p, _ in pairs], [m for _, m in pairs])
            print(f"budget {frac:.3g}: planned vs measured order of the {len(pairs)} searches' choices, Spearman "
                  f"{rho:.2f}{widest_misordered_pair([p for p, _ in pairs], [m for _, m in pairs])}" if len(pairs) > 1
                  else f"budget {frac:.3g}: one measured choice, no order", flush=True)
        for frac, pairs in order_again.items():  # every measured row of the budget, planned with one reading of the rates
            if len(pairs) > 1:
                rho = spearman([p for p, _ in pairs], [m for _, m in pairs])
                print(f"budget {frac:.3g}: planned in one process vs measured order of its {len(pairs)} measured rows, "
                      f"Spearman {rho:.2f}{widest_misordered_pair([p for p, _ in pairs], [m for _, m in pairs])}", flush=True)


def planned(tmp: str, models: tuple[str, ...] = ("gpt_1b", "gpt_10b"), nodes: tuple[str, ...] = tuple(NODES),
            engines: tuple[str, ...] = ENGINES, extra: tuple[str, ...] = ()) -> None:
    print("\n## Planned, not run (the planner's choice per engine)\n")
    out = []
    for model in models:
        for node in nodes:
            base = [f"model={model}", *COMMON, *NODES[node], "strategy.auto.ckpt=[none,full]", *extra]
            for engine in engines:
                ov, row = choice(base, engine, os.path.join(tmp, f"planned-{model}-{engine}-{len(out)}"))
                out.append([model, node, f"{engine} auto", " ".join(o for o in ov if not o.startswith("parallel.tp=1")) if ov
                            else f"none fits: {row.get('why', '')[:80]}", f"{row['step_s']:.3g}" if ov and row.get("step_s") else "-",
                            f"{row['peak'] / 2**30:.1f}" if ov and row.get("peak") else "-"])
    print(table(["model", "node", "engine", "planned choice", "planned step s", "planned peak GiB (max of device, node host)"], out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt_small,moe_small")
    ap.add_argument("--budgets", default="1,0.5,0.25,0.125", help="fractions of plain fp32 DDP's measured peak per rank")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--trials", type=int, default=0, help="strategy.auto.trials of every engine's search: its k fastest "
                    "predicted candidates train a few steps each, the fastest by plan and trial is chosen")
    ap.add_argument("--planned-only", action="store_true")
    ap.add_argument("--planned-models", default="gpt_1b,gpt_10b", help="the models of the planned node tables")
    ap.add_argument("--planned-nodes", default="a100,v100", help="a100 (8x A100 80G) and/or v100 (PatrickStar's node)")
    ap.add_argument("--planned-engines", default=",".join(ENGINES))
    ap.add_argument("--no-planned", dest="planned", action="store_false", help="the measured part only")
    ap.add_argument("--extra", default="", help="space-separated overrides added to every command (a smoke run: "
                    "'strategy.auto.micro_batch_size=[8] strategy.auto.ckpt=[none]')")
    args = ap.parse_args()
    for name, given, known in (("--planned-nodes", args.planned_nodes, NODE_KEYS.values()),
                               ("--planned-engines", args.planned_engines, ENGINES)):
        bad = sorted(set(given.split(",")) - set(known))
        if bad:
            ap.error(f"{name}={given}: unknown {', '.join(bad)}; choose from {', '.join(known)}")
    tmp = bench_dir("fixed_budget")
    print(machine_line())
    if args.planned_only:
        args.planned = True
    else:
        load0 = os.getloadavg()[0]
        measured(args, tmp)
        print(f"\n1-min load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    if args.planned:
        nodes = tuple(n for n in NODES if NODE_KEYS[n] in args.planned_nodes.split(","))
        extra = tuple(args.extra.split()) if args.planned_only else ()  # --extra narrows a planned-only search
        planned(tmp, tuple(args.planned_models.split(",")), nodes, tuple(args.planned_engines.split(",")), extra)


if __name__ == "__main__":
    main()

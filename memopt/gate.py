"""One gate before any rank starts: the config to run, or the job's record when it ends here.

In order: the typed config and its rules (``config.validate``; the run directory claimed first, so a
refusal cannot replace the records of the run it protects), ``+strategy=auto``'s choice (the planner's
search: the fastest predicted candidate that fits), the pipeline's balanced split, plan mode (``trainer.mode=plan``: plan.json, the
table and a suggestion; no rank starts) and the preflight (plan a run near its memory, refuse what
would not fit, set Hybrid Adam's placement from the plan). Every refusal is recorded here through
``outcome``; ``train.run`` launches what passes and turns a record into the exit code.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from memopt import outcome
from memopt.config import ConfigError, to_dataclass, validate
from memopt.logging import write_json


@dataclass
class Verdict:
    """``typed``/``cfg``: the config the ranks get; ``summary``: the job's record when it ends at the gate."""
    typed: Any = None
    cfg: DictConfig | None = None
    summary: dict | None = None


def gate(cfg: DictConfig, run_dir: str, launched: bool) -> Verdict:
    """The gate of one job (``cfg``: the command's composed config). ``launched``: this process is a rank of
    an external launcher (its launch checked)."""
    from memopt.records import RunDirInUse, claim_run_dir

    try:
        typed = to_dataclass(cfg)
        if int(os.environ.get("RANK", "0")) == 0:  # before validation: a refusal must not replace its summary
            claim_run_dir(run_dir, typed.trainer.resume, typed.trainer.overwrite)
        validate(typed)
    except RunDirInUse as e:  # nothing is written: the directory's records belong to the run it protects
        print(f"memopt: configuration refused: {e}", file=sys.stderr)
        return Verdict(summary={"status": "refused", "error": str(e)})
    except ConfigError as e:
        refused = outcome.refusal(run_dir, cfg, str(e))
        print(f"memopt: configuration refused: {e}", file=sys.stderr)
        return Verdict(summary=refused)
    planned = None  # the search's plan of its choice, where the run's own plan would be the same
    if "auto" in typed.strategy.selected():
        chosen = choose_composition(typed, cfg, run_dir)
        if isinstance(chosen, dict):
            return Verdict(summary=chosen)
        typed, cfg, planned = chosen
    from memopt.planner.balance import resolve_split

    resolve_split(cfg, typed)  # split=balanced: the planner's blocks per stage, before any plan or rank
    if typed.trainer.mode == "plan":
        return Verdict(summary=plan_run(typed, cfg, run_dir, planned))
    if typed.trainer.preflight and not launched:
        refused = run_preflight(typed, cfg, run_dir, planned)
        if refused is not None:
            return Verdict(summary=refused)
    return Verdict(typed, cfg)


def hardware(typed, step_rates: bool = False):
    """The run's ``hardware`` profile, resolved on this machine's device; ``step_rates``: with this CPU's
    measured step-time rates (``planner/cpu_rates/``: plan mode and auto rank by the step time; a run's
    preflight only judges the fit)."""
    import torch

    from memopt.memory.hardware import resolve_hardware

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hw = resolve_hardware(typed.hardware, device)
    if step_rates:
        from memopt.memory.host_malloc import keep_freed_blocks
        from memopt.planner.cpu_rates import complete

        if device.type == "cpu" and typed.trainer.cpu_malloc_cache:  # the probes time blocks as the run keeps them
            keep_freed_blocks()
        path = typed.hardware.rates_file
        if path and device.type == "cpu" and not typed.hardware.peak_tflops:  # complete measures: one reading kept
            from memopt.planner.cpu_rates import saved
            from memopt.planner.cpu_rates.block import probe_shape

            entry = saved.key(typed.hardware, probe_shape(typed.model), typed.trainer.cpu_malloc_cache)
            return saved.reading(path, entry, hw, lambda hw: complete(typed.hardware, hw, device, typed.model))
        if path:
            print(f"memopt planner: hardware.rates_file={path} not used: it keeps a CPU's measured rates, and this plan "
                  f"(hardware={typed.hardware.name} on {device.type}) takes the profile's own", file=sys.stderr, flush=True)
        hw = complete(typed.hardware, hw, device, typed.model)  # the probes at the model's shapes
    return hw


def plan_run(typed, cfg: DictConfig, run_dir: str, planned: dict | None = None) -> dict:
    """``trainer.mode=plan``: plan.json, plan.png and summary.json in the run directory, the table printed.
    When the composition does not fit or the engine refuses it at build (the chunk engine checks its
    host budget there), the preflight's suggestion is added: the first composition of its list whose
    plan fits (``planner.preflight.suggestion``), or why none can. ``planned``: the search's plan of this
    composition (``+strategy=auto``), taken as it is."""
    from memopt.planner.figure import plan_figure
    from memopt.planner.placement import plan_placed
    from memopt.planner.plan import fmt, fmt_params, plan_table
    from memopt.planner.preflight import suggestion
    from memopt.planner.simulate import PlanUnsupported
    from memopt.sweep import job_identity

    os.makedirs(run_dir, exist_ok=True)
    try:
        hw = hardware(typed, step_rates=True)
    except ConfigError as e:  # hardware.rates_file holding a rate the plan cannot use
        refused = outcome.refusal(run_dir, cfg, str(e), mode="plan")
        print(f"memopt: plan refused: {e}", file=sys.stderr)
        return refused
    try:
        plan = planned or plan_placed(typed, hw)
    except PlanUnsupported as e:  # a composition the planner cannot follow (named in the message)
        refused = outcome.refusal(run_dir, cfg, str(e), mode="plan")
        print(f"memopt: plan refused: {e}", file=sys.stderr)
        return refused
    except ConfigError as e:  # the engine refuses the composition at build, before allocating it
        plan = _refused_plan(typed, hw, str(e))
    if "error" in plan:  # make_plan's own record of the engine's out-of-memory (chunk warm-up check), or the one above
        plan["status"] = "refused_by_engine"
    else:
        plan["status"] = "fits" if plan["fits"] else "does_not_fit"
    if plan["status"] != "fits":
        plan["suggestion"] = suggestion(typed, hw)
    write_json(os.path.join(run_dir, "plan.json"), plan)
    summary = {"status": "ok", "mode": "plan", "fits": plan["fits"], "plan_status": plan["status"], **job_identity(cfg),
               "params": plan["params"], "world_size": plan["world_size"]}
    if "suggestion" in plan:
        summary["suggestion"] = plan["suggestion"]["overrides"]
    if "error" in plan:
        summary["error"] = plan["error"]
        outcome.record(run_dir, summary)
        print(f"memopt plan: {plan['model']} ({fmt_params(plan['params'])} params) with "
              f"{'+'.join(plan['strategy']) or 'no strategy'} does not fit: refused by the engine "
              f"(hardware {hw.name}): {plan['error']}\n  suggestion: {plan['suggestion']['text']}\n  plan.json in {run_dir}")
        return summary
    summary["planned_peak_bytes"] = plan["peak_bytes"]
    outcome.record(run_dir, summary)
    plan_figure(plan, os.path.join(run_dir, "plan.png"))
    hint = f"\n  suggestion: {plan['suggestion']['text']}" if "suggestion" in plan else ""
    if "placement" in plan:
        p = plan["placement"]
        why = ("this plan's warm-up decision" if p["device_groups"] == p.get("warmup_groups", p["device_groups"]) else
               f"the most the warm-up's moments allow with other parameter chunks evicted; its own margin held "
               f"{p['warmup_groups']}" if p["device_groups"] == p.get("device_max") else
               f"{p['device_max']} allowed by the warm-up's moments, fewer left room for the device's transients; "
               f"its own margin held {p['warmup_groups']}")
        hint = (f"\n  Hybrid Adam: {p['device_groups']} optimizer group(s) per rank on the device from step 0 "
                f"(strategy.hybrid_adam.device_groups={p['device_groups']}, {why}); node host "
                f"{fmt(p['node_host_bytes_warmup_placed'])} if placed after the warm-up") + hint
    print(plan_table(plan) + hint + f"\n  plan.json, plan.png in {run_dir}")
    return summary


def _refused_plan(typed, hw, error: str) -> dict:
    """plan.json's record of a composition the engine refuses at build (what make_plan returns for
    the engine's own out-of-memory)."""
    from dataclasses import asdict

    from memopt import compose
    from memopt.parallel.dims import expected_world

    return {"model": typed.model.name, "params": compose.num_params(typed), "engine": typed.engine.name,
            "strategy": typed.strategy.selected(), "world_size": expected_world(typed), "fits": False,
            "error": error, "hardware": asdict(hw)}


def choose_composition(typed, cfg: DictConfig, run_dir: str):
    """``+strategy=auto``: (typed, DictConfig, the search's plan of it where the run's would be the same, else None)
    of the fastest predicted composition that fits, or the refused record (written) when no candidate fits. The
    candidates are typed copies of the command's config (``planner/candidate.py``); the table prints each as the
    overrides that compose it."""
    from omegaconf import OmegaConf

    from memopt.parallel import under_launcher
    from memopt.planner.search import base_of, check_engine_runs_kept, ranked_table, search

    def progress(done: int, total: int, row: dict, best: dict | None) -> None:
        lead = f"best so far {best['step_s']:.3g} s/step: {best['label']}" if best else "none fits so far"
        what = "fits" if row["fits"] else {"micro-batch": "skipped: a larger micro-batch fits",
                                           "bound": "skipped: its step is slower"}.get(row.get("skipped"), "does not fit")
        print(f"memopt auto: planned {done}/{total} ({what}); {lead}", file=sys.stderr, flush=True)

    try:
        if typed.strategy.auto.trials and under_launcher():
            raise ConfigError(f"strategy.auto.trials={typed.strategy.auto.trials} starts each trial's ranks itself: every "
                              "rank of an external launcher would run its own trials and could choose differently; run "
                              "the search with trainer.nproc_per_node (or strategy.auto.trials=0) under a launcher")
        check_engine_runs_kept(typed)  # before this CPU's rates are measured
        hw = hardware(typed, step_rates=True)
        rows = search(typed, hw, progress=progress)
    except ConfigError as e:  # the search's own refusals (no candidate the engine runs): recorded like the rest
        refused = outcome.refusal(run_dir, cfg, str(e))
        print(f"memopt: configuration refused: {e}", file=sys.stderr)
        return refused
    previous = _previous_choice(run_dir) if typed.trainer.resume else None
    same = [r for r in rows if r["fits"] and r["label"] == previous]
    if same:  # a resumed run keeps the composition its checkpoint was written by (rates and trials vary)
        rows = same + [r for r in rows if r is not same[0]]
        print(f"memopt auto: resuming with the choice of the run being resumed: {previous}", file=sys.stderr)
    print(ranked_table(rows, typed.strategy.auto.top))
    os.makedirs(run_dir, exist_ok=True)
    _write_ranking(run_dir, rows)
    if not rows or not rows[0]["fits"]:
        from memopt.planner.plan import fmt
        from memopt.planner.search import smallest_device_budget

        need = smallest_device_budget(rows, hw, typed)
        why = f"; a budget that works: {fmt(need[0])} on the device for the most frugal candidates ({need[1]}), " \
              f"so hardware.device_memory_gb={math.ceil(need[0] / 2**30 * 1000) / 1000:.3f} or more" if need else ""
        refused = outcome.refusal(run_dir, cfg, f"+strategy=auto: none of {len(rows)} candidates fits{why}")
        print(f"memopt: {refused['error']}", file=sys.stderr)
        return refused
    if typed.strategy.auto.trials and not same:
        from memopt.planner.trials import run_trials, trials_table

        a = typed.strategy.auto
        rows = run_trials(rows, base_of(typed), a.trials, a.trial_steps, run_dir, run_preflight, a.trial_weight)
        print(trials_table(rows))
        _write_ranking(run_dir, rows)  # with the trials: fastest by plan and trial together first
        if "trial" not in rows[0] or rows[0]["trial"]["status"] != "ok":
            ended = ", ".join(f"{r['trial']['status']}" for r in rows if "trial" in r)
            refused = outcome.refusal(run_dir, cfg, f"+strategy=auto: none of the trials of the fastest predicted "
                                                   f"candidates ran ({ended}; their records under {run_dir}/trials)")
            print(f"memopt: {refused['error']}", file=sys.stderr)
            return refused
    print(f"memopt auto: running {rows[0]['label']}")
    chosen = rows[0]["candidate"].config(base_of(typed))
    validate(chosen)
    return chosen, OmegaConf.structured(chosen), _as_run_plans(chosen, rows[0].get("plan"))


def _as_run_plans(typed, plan: dict | None) -> dict | None:
    """The search's plan of its choice where the run's own plan would be the same one: not a Hybrid Adam run whose
    groups the run's plan places first (``plan_placed``), nor a pipeline (its split may be resolved after)."""
    from memopt.planner.placement import places_groups

    return None if places_groups(typed) or getattr(typed.strategy, "pipeline", None) is not None else plan


def _write_ranking(run_dir: str, rows: list[dict]) -> None:
    """auto.json: the ranked rows, without their candidate objects and plans."""
    write_json(os.path.join(run_dir, "auto.json"), [{k: v for k, v in r.items() if k not in ("candidate", "plan")} for r in rows])


def _previous_choice(run_dir: str) -> str | None:
    """The label of the composition an earlier search in ``run_dir`` chose (its auto.json's first row)."""
    import json

    try:
        with open(os.path.join(run_dir, "auto.json")) as f:
            rows = json.load(f)
        return rows[0]["label"] if rows and rows[0].get("fits") else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_preflight(typed, cfg: DictConfig, run_dir: str, planned: dict | None = None) -> dict | None:
    """Plan before launching; the refused record (written) when the run would not fit, else None. ``planned``:
    the search's fitting plan of this composition (``+strategy=auto``), which the preflight then need not make."""
    from memopt.planner.preflight import PreflightRefusal, preflight

    if planned is not None and planned["fits"]:
        return None
    try:
        plan = preflight(typed, hardware(typed))
    except PreflightRefusal as e:
        extra = {}
        if e.plan is not None:
            os.makedirs(run_dir, exist_ok=True)
            write_json(os.path.join(run_dir, "plan.json"), e.plan)
            extra["planned_peak_bytes"] = e.plan["peak_bytes"]
        refused = outcome.refusal(run_dir, cfg, str(e), **extra)
        print(f"memopt: {e}", file=sys.stderr)
        return refused
    n = (plan or {}).get("placement", {}).get("device_groups")
    if n is not None:  # Hybrid Adam's placement, decided by the plan before step 0 (planner/placement.py)
        typed.strategy.hybrid_adam.device_groups = n
        cfg.strategy.hybrid_adam.device_groups = n
        print(f"memopt: preflight: strategy.hybrid_adam.device_groups={n} (optimizer groups on the device from step 0, "
              "as the plan's warm-up placed them)", file=sys.stderr)
    return None

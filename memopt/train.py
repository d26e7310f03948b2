"""``python -m memopt.train``: compose the config, validate it, run the loop.

Thin on purpose: everything that decides what happens lives in config.py (rules), compose.py and
the engines (strategy order) and trainer.py (the loop). A run that fails writes ``summary.json`` with its status;
in a multirun the failure is recorded and the sweep goes on.
"""
from __future__ import annotations

import math
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf


from memopt.config import CONF_DIR, ConfigError, register_configs, to_dataclass, validate
from memopt.errors import EXIT_CODES
from memopt.parallel import under_launcher
from memopt.logging import read_summary, write_json, write_summary
from memopt.records import RunDirInUse, claim_run_dir
from memopt.watchdog import WATCHED_BY_LAUNCHER

register_configs()

def _fmt_bytes(n: int | None) -> str:
    if not n:
        return "0"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def summary_table(summary: dict) -> str:
    """A short human-readable table of a run's summary.json."""
    def num(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    rows = [
        ("status", summary.get("status")),
        ("strategy", "+".join(summary.get("strategy") or ["plain"]) + f" ({summary.get('engine')})"),
        ("model / params", f"{summary.get('model')} / {summary.get('params', 0) / 1e6:.2f}M"),
        ("final loss / val loss", f"{num(summary.get('final_loss'), '.4f')} / {num(summary.get('val_loss'), '.4f')}"),
        ("tokens/s (median)", num(summary.get("tokens_per_s"), ",.0f")),
        ("TFLOP/s / MFU", f"{num(summary.get('tflops'), '.4f')} / {num(summary.get('mfu'), '.1%')}"),
    ]
    for rank, devs in (summary.get("peak_bytes") or {}).items():
        for dev, cats in devs.items():
            parts = ", ".join(f"{c} {_fmt_bytes(b)}" for c, b in cats.items() if c != "total" and b)
            rows.append((f"peak rank {rank} {dev}", f"{_fmt_bytes(cats.get('total'))} ({parts})"))
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def run(cfg: DictConfig) -> dict:
    """Validate and run one job in this process; returns its summary."""
    from memopt.trainer import Trainer

    run_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else os.getcwd()
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    group = cfg.logger.group or cfg.experiment
    if group is None and multirun:
        group = os.path.basename(os.path.normpath(HydraConfig.get().sweep.dir))
    try:
        typed = to_dataclass(cfg)
        if int(os.environ.get("RANK", "0")) == 0:  # before validation: a refusal must not replace its summary
            claim_run_dir(run_dir, typed.trainer.resume, typed.trainer.overwrite)
        validate(typed)
    except RunDirInUse as e:  # nothing is written: the directory's records belong to the run it protects
        print(f"memopt: configuration refused: {e}", file=sys.stderr)
        if multirun:
            return {"status": "refused", "error": str(e)}
        raise SystemExit(EXIT_CODES["refused"])
    except ConfigError as e:
        refused = _record_refusal(run_dir, cfg, str(e))
        print(f"memopt: configuration refused: {e}", file=sys.stderr)
        if multirun:
            return refused
        raise SystemExit(2)
    if "auto" in typed.strategy.selected():
        chosen = choose_composition(typed, cfg, run_dir)
        if chosen is None:
            if multirun:
                return {"status": "refused"}
            raise SystemExit(2)
        typed, cfg = chosen
    from memopt.planner.balance import resolve_split

    resolve_split(cfg, typed)  # split=balanced: the planner's blocks per stage, before any plan or rank
    if typed.trainer.mode == "plan":
        return plan_run(typed, cfg, run_dir, multirun)
    if typed.trainer.preflight and not under_launcher():
        refused = run_preflight(typed, cfg, run_dir)
        if refused is not None:
            if multirun:
                return refused
            raise SystemExit(2)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    nproc = typed.trainer.nproc_per_node
    try:
        if nproc > 1 and not under_launcher():
            summary = _launch_ranks(nproc, resolved, run_dir, group)
        else:
            if under_launcher():  # external torchrun: every rank uses rank 0's run directory
                run_dir = _shared_run_dir(typed, run_dir)
            summary = Trainer(typed, run_dir, resolved, group=group).run()
            if summary is None or int(os.environ.get("RANK", "0")) != 0:
                return summary
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        import traceback

        from memopt.errors import Recorded, RunStopped, WriteError
        from memopt.parallel import RankFailure

        # a refusal's or a failed save's one-line reason is the message, a crashed rank's traceback was printed
        # by the launch (HYDRA_FULL_ERROR=1 shows this process's traceback too)
        if not isinstance(e, (RunStopped, ConfigError, WriteError, RankFailure)) or os.environ.get("HYDRA_FULL_ERROR") == "1":
            traceback.print_exc()
        status = _recorded_status(run_dir)
        what = str(e) if isinstance(e, Recorded) else f"{type(e).__name__}: {e}"
        print(f"memopt: run {status} ({what}); summary in {run_dir}/summary.json", file=sys.stderr)
        if multirun:
            return {"status": status, "error": str(e)}
        raise SystemExit(EXIT_CODES[status]) from None
    print(f"\nmemopt run finished in {run_dir}\n{summary_table(summary)}", file=sys.stderr)
    return summary


def _task_overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _hardware(typed, step_rates: bool = False):
    """The profile resolved here; ``step_rates``: with the CPU's measured step-time rates (plan mode and
    auto rank by the step time; a run's preflight only judges the fit)."""
    import torch

    from memopt.memory.hardware import resolve_hardware

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hw = resolve_hardware(typed.hardware, device)
    if step_rates:
        from memopt.planner.cpu_rates import complete

        hw = complete(typed.hardware, hw, device)
    return hw


def plan_run(typed, cfg: DictConfig, run_dir: str, multirun: bool) -> dict:
    """``trainer.mode=plan``: plan.json, plan.png and summary.json in the run directory, the table printed.
    When the composition does not fit or the engine refuses it at build (the chunk engine checks its
    host budget there), the preflight's suggestion is added: the first composition of its list whose
    plan fits (``planner.preflight.suggestion``), or why none can."""
    from memopt.planner.figure import plan_figure
    from memopt.planner.placement import plan_placed
    from memopt.planner.plan import fmt, fmt_params, plan_table
    from memopt.planner.preflight import suggestion
    from memopt.planner.simulate import PlanUnsupported
    from memopt.sweep import job_identity

    os.makedirs(run_dir, exist_ok=True)
    hw = _hardware(typed, step_rates=True)
    try:
        plan = plan_placed(typed, hw)
    except PlanUnsupported as e:  # a composition the planner cannot follow (named in the message)
        refused = _record_refusal(run_dir, cfg, str(e), mode="plan")
        print(f"memopt: plan refused: {e}", file=sys.stderr)
        if multirun:
            return refused
        raise SystemExit(2)
    except ConfigError as e:  # the engine refuses the composition at build, before allocating it
        plan = _refused_plan(typed, hw, str(e))
    if "error" in plan:  # make_plan's own record of the engine's out-of-memory (chunk warm-up check), or the one above
        plan["status"] = "refused_by_engine"
    else:
        plan["status"] = "fits" if plan["fits"] else "does_not_fit"
    if plan["status"] != "fits":
        plan["suggestion"] = suggestion(typed, hw, _task_overrides())
    write_json(os.path.join(run_dir, "plan.json"), plan)
    summary = {"status": "ok", "mode": "plan", "fits": plan["fits"], "plan_status": plan["status"], **job_identity(cfg),
               "params": plan["params"], "world_size": plan["world_size"]}
    if "suggestion" in plan:
        summary["suggestion"] = plan["suggestion"]["overrides"]
    if "error" in plan:
        summary["error"] = plan["error"]
        write_summary(run_dir, summary)
        print(f"memopt plan: {plan['model']} ({fmt_params(plan['params'])} params) with "
              f"{'+'.join(plan['strategy']) or 'no strategy'} does not fit: refused by the engine "
              f"(hardware {hw.name}): {plan['error']}\n  suggestion: {plan['suggestion']['text']}\n  plan.json in {run_dir}")
        return summary
    summary["planned_peak_bytes"] = plan["peak_bytes"]
    write_summary(run_dir, summary)
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


def choose_composition(typed, cfg: DictConfig, run_dir: str, overrides: list[str] | None = None):
    """``+strategy=auto``: (typed, DictConfig) of the fastest predicted composition that fits, or None
    (refused summary written) when no candidate fits. ``overrides``: the command's (default: Hydra's task
    overrides; ``memopt.api.run_job`` passes its own)."""
    from memopt.config import compose_config
    from memopt.planner.search import ranked_table, search, split_base

    overrides = _task_overrides() if overrides is None else list(overrides)
    base = split_base(overrides)[0]  # candidates carry the strategies (and MoE's options) they need
    def progress(done: int, total: int, row: dict, best: dict | None) -> None:
        lead = f"best so far {best['step_s']:.3g} s/step: {best['label']}" if best else "none fits so far"
        what = "fits" if row["fits"] else "skipped: a larger micro-batch fits" if row.get("skipped") else "does not fit"
        print(f"memopt auto: planned {done}/{total} ({what}); {lead}",
              file=sys.stderr, flush=True)

    hw = _hardware(typed, step_rates=True)
    rows = search(typed, hw, overrides, progress=progress)
    print(ranked_table(rows, typed.strategy.auto.top))
    os.makedirs(run_dir, exist_ok=True)
    write_json(os.path.join(run_dir, "auto.json"), rows)
    if not rows or not rows[0]["fits"]:
        from memopt.planner.plan import fmt
        from memopt.planner.search import smallest_device_budget

        need = smallest_device_budget(rows, hw, overrides, typed)
        why = f"; a budget that works: {fmt(need[0])} on the device for the most frugal candidates ({need[1]}), " \
              f"so hardware.device_memory_gb={math.ceil(need[0] / 2**30 * 1000) / 1000:g} or more" if need else ""
        refused = _record_refusal(run_dir, cfg, f"+strategy=auto: none of {len(rows)} candidates fits{why}")
        print(f"memopt: {refused['error']}", file=sys.stderr)
        return None
    print(f"memopt auto: running {rows[0]['label']}")
    new = compose_config([*base, *rows[0]["overrides"]])
    chosen = to_dataclass(new)
    validate(chosen)
    return chosen, new


def run_preflight(typed, cfg: DictConfig, run_dir: str) -> dict | None:
    """Plan before launching; the refused summary (written) when the run would not fit, else None."""
    from memopt.planner.preflight import PreflightRefusal, preflight

    try:
        plan = preflight(typed, _hardware(typed), _task_overrides())
    except PreflightRefusal as e:
        extra = {}
        if e.plan is not None:
            os.makedirs(run_dir, exist_ok=True)
            write_json(os.path.join(run_dir, "plan.json"), e.plan)
            extra["planned_peak_bytes"] = e.plan["peak_bytes"]
        refused = _record_refusal(run_dir, cfg, str(e), **extra)
        print(f"memopt: {e}", file=sys.stderr)
        return refused
    n = (plan or {}).get("placement", {}).get("device_groups")
    if n is not None:  # Hybrid Adam's placement, decided by the plan before step 0 (planner/placement.py)
        typed.strategy.hybrid_adam.device_groups = n
        cfg.strategy.hybrid_adam.device_groups = n
        print(f"memopt: preflight: strategy.hybrid_adam.device_groups={n} (optimizer groups on the device from step 0, "
              "as the plan's warm-up placed them)", file=sys.stderr)
    return None


def _record_refusal(run_dir: str, cfg: DictConfig, error: str, **extra) -> dict:
    """Write and return the summary.json of a job refused before it ran (the report names what was
    refused through the job's identity)."""
    from memopt.sweep import job_identity

    refused = {"status": "refused", "error": error, **extra, **job_identity(cfg)}
    write_summary(run_dir, refused)
    return refused


def _recorded_status(run_dir: str) -> str:
    """The status the failed run wrote into its summary.json (``failed`` when it wrote none)."""
    status = (read_summary(run_dir) or {}).get("status")
    return status if status in EXIT_CODES and status != "ok" else "failed"


def _summary_so_far(run_dir: str, resolved: dict) -> dict:
    """What the ranks recorded in summary.json, over the job's identity (a rank that stopped before
    its Trainer started wrote nothing)."""
    from memopt.sweep import job_identity

    return {**job_identity(OmegaConf.create(resolved)), **(read_summary(run_dir) or {})}


def _launch_ranks(nproc: int, resolved: dict, run_dir: str, group: str | None) -> dict:
    """Start ``nproc`` local ranks; on failure record which rank failed and why, then re-raise."""
    from memopt.errors import Interrupted
    from memopt.parallel import RankFailure, launch
    from memopt.worker import run_rank

    watchdog = _watch_ranks(run_dir, resolved["trainer"].get("watchdog_s") or 0)
    try:
        results = launch(nproc, run_rank, resolved, run_dir, group)
    except Interrupted as e:  # the launcher's signal is the cause; what rank 0 recorded of its stop stays beside it
        summary = _summary_so_far(run_dir, resolved)
        ranks = summary.get("error") if summary.get("status") == "interrupted" else None
        summary.update(status="interrupted", error=str(e) + (f" (rank 0: {ranks})" if ranks else ""))
        write_summary(run_dir, summary)
        raise
    except RankFailure as e:
        summary = _summary_so_far(run_dir, resolved)
        recorded = summary.get("status")  # what the ranks decided (oom, refused, diverged, interrupted)
        if e.clean and recorded in EXIT_CODES and recorded != "ok" and summary.get("error"):
            from memopt.errors import Recorded  # rank 0's record is the outcome: said in one line

            raise Recorded(recorded, summary["error"]) from None
        if recorded in EXIT_CODES and recorded not in ("ok", "failed"):
            summary.setdefault("error", str(e))
        else:
            summary.update(status="failed", error=str(e), failed_rank=e.rank)
        if watchdog is not None and watchdog.fired:  # the watchdog stopped the ranks: its finding is the cause
            from memopt.errors import Stalled

            summary.update(status="failed", error=watchdog.fired[1], stalled_rank=watchdog.fired[0])
            summary.pop("failed_rank", None)
            if summary.get("steps_done") is None:  # the ranks were killed before recording it
                summary["steps_done"] = watchdog.steps_done()
            write_summary(run_dir, summary)
            raise Stalled(watchdog.fired[1]) from None
        write_summary(run_dir, summary)
        raise
    finally:
        if watchdog is not None:
            watchdog.close()
            os.environ.pop(WATCHED_BY_LAUNCHER, None)
    return results[0]


def _watch_ranks(run_dir: str, limit: float):
    """The watchdog over the local ranks' heartbeats (``trainer.watchdog_s`` > 0): when one stalls, it
    names it and SIGKILLs every rank (a stopped process included), so the launch fails at once."""
    if not limit:
        return None
    import shutil
    import signal

    from memopt.watchdog import DIR, Watchdog

    def stop_all(rank: int, message: str, beats: dict) -> None:
        print(f"memopt: {message}; stopping the job", file=sys.stderr)
        for b in beats.values():
            try:
                os.kill(int(b["pid"]), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    shutil.rmtree(os.path.join(run_dir, DIR), ignore_errors=True)
    os.environ[WATCHED_BY_LAUNCHER] = "1"  # inherited by the spawned ranks: they publish, this process watches
    return Watchdog(run_dir, limit, stop_all)


def _shared_run_dir(typed, run_dir: str) -> str:
    """Under an external launcher, adopt rank 0's Hydra directory (others remove their own)."""
    import shutil

    import torch.distributed as dist

    from memopt.parallel.launch import join
    from memopt.trainer import resolve_device

    join(resolve_device(typed.trainer.device))
    box = [run_dir]
    dist.broadcast_object_list(box, src=0)
    shared = box[0]
    if shared != run_dir and dist.get_rank() != 0:
        shutil.rmtree(run_dir, ignore_errors=True)
    return shared


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from memopt.cluster import adopt_submitit_ranks

    adopt_submitit_ranks()  # a multi-task submitit (SLURM) job: one rank per task, as under torchrun
    run(cfg)


def main() -> None:
    """The CLI: a command Hydra cannot compose (an unknown key, group option or a wrong type) is refused
    like any bad input (summary.json, exit 2) before Hydra's own exit 1 without a record."""
    from memopt.cli_gate import refuse_uncomposable

    refuse_uncomposable(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()

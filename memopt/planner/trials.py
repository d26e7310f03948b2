"""``strategy.auto.trials=k``: the search's k fastest predicted candidates train a few steps each, and the one
whose plan and trial together say it is fastest runs: ordered by planned^(1-w) x measured^w, ``w`` =
``strategy.auto.trial_weight`` (0.5: the geometric mean of the two estimates of one step).

Why: on a CPU the step-time model is within ~10% of the measured step (``experiments/step_time``), so
candidates planned within 10% of each other are not ordered by it (moe_small at half of DDP's peak: the
search put Hybrid Adam bf16 6% ahead of bf16 + DDP with ep=2, which ran 6% faster). DeepSpeed's autotuner
measures every experiment it launches; this measures only the few the plan cannot separate. Each trial is
the candidate's run as the CLI starts it (the pipeline's split, the preflight's placement, the ranks, the
device budget held by the tracker), shortened to ``trial_steps`` steps without evaluation, checkpoint or
logger, in ``<run dir>/trials/<i>`` (emptied first): a trial that crosses the budget ends ``oom`` there and
drops out, so the winner's peak was measured under the budget too. Trials run in plan mode as well: they are
the search's measurements, and plan mode then plans the winner.
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import replace


def trial_config(chosen, steps: int):
    """The candidate's typed config, shortened to a trial: ``steps`` steps, the first one's warm-up excluded
    from the median, nothing evaluated, saved, resumed or logged."""
    t = replace(chosen.trainer, mode="train", max_steps=steps, throughput_warmup_steps=1, eval_every=0,
                save_checkpoint=False, checkpoint_every=0, resume=None, overwrite=True, progress_bar=False,
                count_comm=False)
    return replace(chosen, trainer=t, logger=replace(chosen.logger, name="none"))


def run_trials(rows: list[dict], base, k: int, steps: int, run_dir: str, preflight, weight: float) -> list[dict]:
    """Train the first ``k`` fitting rows of ``rows`` (planned order; ``base``: the config candidates compose
    on) for ``steps`` steps each; sets each tried row's ``trial`` ({status, step_s, peak_bytes, dir}) and
    returns the rows reordered: the tried ones that ran, fastest by plan and trial first, then the rest as planned.
    ``weight`` (``strategy.auto.trial_weight``): how much the measured step counts against the planned one
    (``by_plan_and_trial``).
    ``preflight(typed, cfg, run_dir)``: the gate's (a refusal's record, or None with the run's placement set)."""
    shutil.rmtree(os.path.join(run_dir, "trials"), ignore_errors=True)  # an earlier search's trials
    tried = [r for r in rows if r["fits"]][:k]
    for i, r in enumerate(tried):
        where = os.path.join(run_dir, "trials", str(i))
        print(f"memopt auto: trial {i + 1}/{len(tried)} ({steps} steps): {r['label']}", file=sys.stderr, flush=True)
        summary = _trial(r, base, steps, where, preflight)
        peak = max((cats.get("total", 0) for v in (summary.get("peak_bytes") or {}).values()
                    for dev, cats in v.items() if dev != "host"), default=None)  # the device's, over the ranks
        r["trial"] = {"status": summary.get("status", "failed"), "step_s": summary.get("step_time_s"),
                      "peak_bytes": peak, "dir": where}
        if r["trial"]["status"] == "interrupted":  # a stop request for the whole command, not this trial's verdict
            from memopt.errors import Interrupted

            raise Interrupted(f"stopped during +strategy=auto's trial {i + 1} ({summary.get('error', '')}); its record "
                              f"in {where}")
        if r["trial"]["status"] != "ok":
            print(f"memopt auto: trial {i + 1} ended {r['trial']['status']}: {summary.get('error', '')}", file=sys.stderr)
    ran = by_plan_and_trial([r for r in tried if r["trial"]["status"] == "ok" and r["trial"]["step_s"]], weight)
    first = {id(r) for r in ran}
    return ran + [r for r in rows if id(r) not in first]


def by_plan_and_trial(ran: list[dict], weight: float) -> list[dict]:
    """``ran`` (tried rows that ran, in planned order) by planned^(1-weight) x measured^weight, fastest first (ties
    keep the planned order); with a row whose plan is unknown, by the measured step alone. Why both: each estimates
    the same step with an error of about the same size on a shared CPU, the plan's ~10-30% by engine
    (experiments/step_time), a trial's few steps up to 40% between launches a minute apart (experiments/fixed_budget),
    so at 0.5 a trial overturns the plan's order by measuring the other faster by more than the plan put it behind.
    The measured order alone chose on noise (moe_small at 25%, 2026-11-28: 8 x 2 planned 6.87 s and measured 10.27
    in its trial, 4 x 4 planned 7.49 and measured 9.73; 8 x 2 was the faster in every alternating run after: the
    geometric mean keeps it, 8.40 against 8.54). The fixed margin used before (a trial had to measure 10% faster)
    kept the plan's first however close the plan had them (gpt_small at 50%, 2026-11-29: Hybrid Adam 16 x 1 planned
    5.49 s and measured 6.62 against bf16 DDP 8 x 2's 6.00, then ran 7.77 s a step against DDP's 6.02)."""
    if any(r.get("step_s") is None for r in ran):
        return sorted(ran, key=lambda r: r["trial"]["step_s"])
    return sorted(ran, key=lambda r: r["step_s"] ** (1 - weight) * r["trial"]["step_s"] ** weight)


def _trial(row: dict, base, steps: int, where: str, preflight) -> dict:
    """One trial's summary (its record in ``where``); whatever stops it is its status, never the search's."""
    from omegaconf import OmegaConf

    from memopt import ranks
    from memopt.errors import status_of

    try:
        from memopt.config import validate
        from memopt.planner.balance import resolve_split

        typed = trial_config(row["candidate"].config(base), steps)
        validate(typed)
        cfg = OmegaConf.structured(typed)
        resolve_split(cfg, typed)  # split=balanced: the planner's blocks per stage, as the gate resolves them
        refused = preflight(typed, cfg, where) if typed.trainer.preflight else None  # and Hybrid Adam's placement
        if refused is not None:
            return refused
        return ranks.start(typed, cfg, where, None) or {}
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # noqa: BLE001 - recorded as this trial's outcome; the other trials still run
        ranks.failure(e, where)  # says how it ended (a crash's traceback)
        from memopt import outcome

        summary = outcome.read(where) or {}
        if summary.get("status") in (None, "ok"):  # stopped before its ranks recorded anything
            summary = {"status": status_of(e), "error": str(e)}
        return summary


def trials_table(rows: list[dict]) -> str:
    """The trials, planned against measured, in the order they ran."""
    tried = sorted((r for r in rows if "trial" in r), key=lambda r: int(os.path.basename(r["trial"]["dir"])))
    lines = ["memopt auto: trials (planned / measured s per step):"]
    for r in tried:
        t = r["trial"]
        got = f"{t['step_s']:.3g}" if t["status"] == "ok" and t["step_s"] else t["status"]
        planned = f"{r['step_s']:.3g}" if r.get("step_s") is not None else "unknown"
        lines.append(f"  {planned} / {got}: {r['label']}")
    return "\n".join(lines)

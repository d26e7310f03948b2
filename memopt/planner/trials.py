"""``strategy.auto.trials=k``: the search's k fastest predicted candidates train a few steps each, and the
fastest measured one is run, unless it measured less than ``trial_margin`` faster than the plan's first.

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


def run_trials(rows: list[dict], base, k: int, steps: int, run_dir: str, preflight, margin: float) -> list[dict]:
    """Train the first ``k`` fitting rows of ``rows`` (planned order; ``base``: the config candidates compose
    on) for ``steps`` steps each; sets each tried row's ``trial`` ({status, step_s, peak_bytes, dir}) and
    returns the rows reordered: the tried ones that ran, fastest measured first, then the rest as planned.
    ``margin`` (``strategy.auto.trial_margin``): the first planned of those that ran stays first unless another
    measured at least that fraction faster (``planned_unless_faster``).
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
        if r["trial"]["status"] != "ok":
            print(f"memopt auto: trial {i + 1} ended {r['trial']['status']}: {summary.get('error', '')}", file=sys.stderr)
    ran = planned_unless_faster([r for r in tried if r["trial"]["status"] == "ok" and r["trial"]["step_s"]], margin)
    first = {id(r) for r in ran}
    return ran + [r for r in rows if id(r) not in first]


def planned_unless_faster(ran: list[dict], margin: float) -> list[dict]:
    """``ran`` (tried rows that ran, in planned order) fastest measured first, except that the first planned stays
    first unless the fastest measured at least ``margin`` faster than it. Why: a trial is 2-3 steps of one launch,
    and on a shared VM two launches a minute apart differ by up to 40% (experiments/fixed_budget: moe_small at 25%,
    the plan's first at 8 x 2 measured 8.1 s in one search's trial and 10.3 s in the next, where 4 x 4 measured
    11.5 s and 9.7 s; alternating runs, 8 x 2 7.4-8.2 s, 4 x 4 8.5-11.0 s): a measured difference under the
    plan's own error does not overturn the plan."""
    by_step = sorted(ran, key=lambda r: r["trial"]["step_s"])
    if not ran or by_step[0] is ran[0] or by_step[0]["trial"]["step_s"] < (1 - margin) * ran[0]["trial"]["step_s"]:
        return by_step
    return [ran[0], *(r for r in by_step if r is not ran[0])]


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

"""``strategy.auto.trials=k``: the search's k fastest predicted candidates train a few steps each, and the
fastest measured one is run.

Why: on a CPU the step-time model is within ~10% of the measured step (``experiments/step_time``), so
candidates planned within 10% of each other are not ordered by it (moe_small at half of DDP's peak: the
search put Hybrid Adam bf16 6% ahead of bf16 + DDP with ep=2, which ran 6% faster). DeepSpeed's autotuner
measures every experiment it launches; this measures only the few the plan cannot separate. Each trial is
the candidate's run as the CLI starts it (the preflight's placement, the ranks, the device budget held by
the tracker), shortened to ``trial_steps`` steps without evaluation, checkpoint or logger, in
``<run dir>/trials/<i>``: a trial that crosses the budget ends ``oom`` there and drops out, so the winner's
peak was measured under the budget too.
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace


def trial_config(chosen, steps: int):
    """The candidate's typed config, shortened to a trial: ``steps`` steps, the first one's warm-up excluded
    from the median, nothing evaluated, saved or logged."""
    t = replace(chosen.trainer, mode="train", max_steps=steps, throughput_warmup_steps=1, eval_every=0, save_checkpoint=False,
                checkpoint_every=0, resume=None, overwrite=True, progress_bar=False, count_comm=False)
    return replace(chosen, trainer=t, logger=replace(chosen.logger, name="none"))


def run_trials(rows: list[dict], base, k: int, steps: int, run_dir: str, preflight) -> list[dict]:
    """Train the first ``k`` fitting rows of ``rows`` (planned order; ``base``: the config candidates compose
    on) for ``steps`` steps each; sets each tried row's ``trial`` ({status, step_s, peak_bytes, dir}) and
    returns the rows reordered: the tried ones that ran, fastest measured first, then the rest as planned.
    ``preflight(typed, cfg, run_dir)``: the gate's (a refusal's record, or None with the run's placement set)."""
    from omegaconf import OmegaConf

    from memopt import ranks
    from memopt.config import validate

    tried = [r for r in rows if r["fits"] and r.get("step_s") is not None][:k]
    for i, r in enumerate(tried):
        typed = trial_config(r["candidate"].config(base), steps)
        validate(typed)
        cfg = OmegaConf.structured(typed)
        where = os.path.join(run_dir, "trials", str(i))
        print(f"memopt auto: trial {i + 1}/{len(tried)} ({steps} steps): {r['label']}", file=sys.stderr, flush=True)
        summary = preflight(typed, cfg, where)  # the placement a run of it would get (Hybrid Adam's groups)
        if summary is None:
            try:
                summary = ranks.start(typed, cfg, where, None) or {}
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as e:  # noqa: BLE001 - its record is in its summary.json; the others still run
                from memopt.errors import status_of

                ranks.failure(e, where)  # says how it ended (a crash's traceback)
                summary = _recorded(where)
                if summary.get("status") in (None, "ok"):  # stopped before its ranks recorded anything
                    summary = {"status": status_of(e), "error": str(e)}
        peak = max((cats.get("total", 0) for v in (summary.get("peak_bytes") or {}).values()
                    for dev, cats in v.items() if dev != "host"), default=None)  # the device's, over the ranks
        r["trial"] = {"status": summary.get("status", "failed"), "step_s": summary.get("step_time_s"),
                      "peak_bytes": peak, "dir": where}
    ran = sorted((r for r in tried if r["trial"]["status"] == "ok" and r["trial"]["step_s"]),
                 key=lambda r: r["trial"]["step_s"])
    return ran + [r for r in rows if r not in ran]


def _recorded(run_dir: str) -> dict:
    from memopt import outcome

    return outcome.read(run_dir) or {}


def trials_table(rows: list[dict]) -> str:
    """The trials, planned against measured, in the order they ran."""
    tried = sorted((r for r in rows if "trial" in r), key=lambda r: r["trial"]["dir"])
    lines = ["memopt auto: trials (planned / measured s per step):"]
    for r in tried:
        t = r["trial"]
        got = f"{t['step_s']:.3g}" if t["status"] == "ok" and t["step_s"] else t["status"]
        lines.append(f"  {r['step_s']:.3g} / {got}: {r['label']}")
    return "\n".join(lines)

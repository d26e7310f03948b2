"""``python -m memopt.train``: compose, gate, launch, exit code.

The CLI only: Hydra composes the config (``cli_gate`` refuses a command it cannot compose), the gate
(``gate.py``) validates it and plans where asked (plan mode, ``+strategy=auto``, the preflight), the
ranks run what passes (``ranks.py``), and ``outcome.end`` turns the job's record into the exit code.
In a multirun a job's failure is recorded and the sweep goes on.
"""
from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from memopt import outcome
from memopt.config import CONF_DIR, register_configs

register_configs()


def run(cfg: DictConfig) -> dict:
    """One job in this process: the gate, then the ranks; returns its summary (exits with its code)."""
    from memopt import ranks
    from memopt.errors import Interrupted, StopRequest
    from memopt.gate import gate
    from memopt.parallel import under_launcher
    from memopt.sweep import job_identity
    from memopt.records import run_record

    hydra_on = HydraConfig.initialized()
    run_dir = HydraConfig.get().runtime.output_dir if hydra_on else os.getcwd()
    multirun = hydra_on and HydraConfig.get().mode == RunMode.MULTIRUN
    group = cfg.logger.group or cfg.experiment
    if group is None and multirun:
        group = os.path.basename(os.path.normpath(HydraConfig.get().sweep.dir))
    try:
        with outcome.stops_raise():  # planning (auto's search and trials, the preflight) takes seconds to minutes
            verdict = gate(cfg, run_dir, under_launcher())
    except (StopRequest, Interrupted) as e:  # Interrupted: a trial's (launch gives the caller's handlers back)
        # trained nothing: marked so, as a refusal is, with the run the directory holds (if any) kept under previous
        stopped = {"status": "interrupted", "error": str(e), "before_ranks": True, **job_identity(cfg)}
        held = run_record(outcome.read(run_dir))
        if held is not None:
            stopped["previous"] = held
        outcome.record(run_dir, stopped)
        print(f"memopt: run interrupted ({e}); summary in {run_dir}/summary.json", file=sys.stderr)
        return outcome.end(stopped, multirun)
    if verdict.summary is not None:  # refused, or planned (trainer.mode=plan): no rank starts
        return outcome.end(verdict.summary, multirun)
    failed = None
    try:
        summary = ranks.start(verdict.typed, verdict.cfg, run_dir, group)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        failed = ranks.failure(e, run_dir)
    if failed is not None:  # the ranks' record (and the launch's additions) is in summary.json
        return outcome.end(failed, multirun)
    if summary is None or int(os.environ.get("RANK", "0")) != 0:
        return summary
    print(f"\nmemopt run finished in {run_dir}\n{outcome.summary_table(summary)}", file=sys.stderr)
    return summary


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from memopt.cluster import adopt_submitit_ranks

    adopt_submitit_ranks()  # a multi-task submitit (SLURM) job: one rank per task, as under torchrun
    run(cfg)


def main() -> None:
    """The CLI: a command Hydra cannot compose (an unknown key, group option or a wrong type) is refused
    like any bad input (summary.json, exit 2) before Hydra's own exit 1 without a record."""
    import warnings

    from memopt.cli_gate import refuse_uncomposable

    # a warning on the terminal is its message and where it was raised, not that line's source as well
    warnings.formatwarning = lambda message, category, filename, lineno, line=None: \
        f"{filename}:{lineno}: {category.__name__}: {message}\n"
    refuse_uncomposable(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()

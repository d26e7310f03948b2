"""What a multirun does when its jobs are done: the sweep's report, and an exit code that says whether
anything worked.

``SweepReport`` is a Hydra callback (registered under ``hydra.callbacks`` in conf/train.yaml). Jobs
record their failures in summary.json and return, so that one bad job does not stop a sweep; the
callback then writes report.md / report.html into the sweep directory and, when no job finished,
exits non-zero so that scripts and CI notice. It reads the jobs' run records rather than Hydra's
job returns, so it works the same with the basic, joblib and submitit launchers.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from hydra.experimental.callback import Callback


def job_identity(cfg) -> dict:
    """engine, strategies, model and world size a job was asked to run, from its (possibly invalid)
    config: a refused job's summary.json names them even though no trainer was built."""
    out: dict[str, Any] = {}
    for key, get in (("engine", lambda: cfg.engine.name), ("model", lambda: cfg.model.name),
                     ("world_size", lambda: int(cfg.trainer.nproc_per_node)),
                     ("strategy", lambda: [k for k, v in (cfg.get("strategy") or {}).items() if v is not None])):
        try:
            out[key] = get()
        except Exception:  # noqa: BLE001 - an invalid config may fail anywhere; keep what can be read
            pass
    return out


class SweepReport(Callback):
    def __init__(self, report: bool = True, fail_when_all_failed: bool = True) -> None:
        self.report = report
        self.fail_when_all_failed = fail_when_all_failed

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        from memopt.report import write_report
        from memopt.report.collect import collect_runs

        sweep_dir = str(config.hydra.sweep.dir)
        runs = collect_runs([sweep_dir]) if os.path.isdir(sweep_dir) else []
        if self.report and runs:
            try:
                paths = write_report(runs, sweep_dir, [sweep_dir])
                print(f"memopt: sweep report in {paths['html']} (and report.md); "
                      f"compare again with: python -m memopt.report {sweep_dir}", file=sys.stderr)
            except Exception as e:  # noqa: BLE001 - a broken figure must not hide the jobs' results
                print(f"memopt: could not write the sweep report ({type(e).__name__}: {e})", file=sys.stderr)
        ok = sum(r.ok for r in runs)
        if self.fail_when_all_failed and ok == 0:
            statuses = ", ".join(f"{r.job}: {r.status}" for r in runs) or "no job wrote a run record"
            print(f"memopt: every job of the sweep failed ({statuses})", file=sys.stderr)
            raise SystemExit(1)

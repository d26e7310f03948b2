"""Who owns a run directory: the run id stamped on every record, and the refusal to mix two runs.

A run directory holds one run's records (``metrics.jsonl``, ``summary.json``, ``model.pt``,
``checkpoints/``). Starting a second run into it would interleave the metrics and silently replace
the summary and the weights, so it is refused unless the new run resumes the old one
(``trainer.resume``: its records are appended, each carrying the new attempt's ``run_id``) or is told
to start over (``trainer.overwrite=true``: the old records are removed first).
"""
from __future__ import annotations

import os
import secrets
import shutil
import time

from memopt.errors import ConfigError

RECORDS = ("metrics.jsonl", "summary.json", "model.pt", "checkpoints")  # what a run leaves in its directory


class RunDirInUse(ConfigError):
    """The run directory already holds a run; refused without writing anything into it (a summary
    would replace the one it protects)."""


def new_run_id() -> str:
    """Sortable and unique enough for one directory's attempts: UTC time plus 6 random hex digits."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def prior_records(run_dir: str) -> list[str]:
    return [name for name in RECORDS if os.path.exists(os.path.join(run_dir, name))]


def claim_run_dir(run_dir: str, resume: str | None, overwrite: bool) -> None:
    """Refuse a directory that already holds a run, unless this run resumes it or overwrites it
    (then the old records are removed here, before anything is written)."""
    prior = prior_records(run_dir)
    if not prior:
        return
    if resume:
        from memopt.checkpoint import complete

        if complete(run_dir):  # the new attempt continues this directory's own run
            return
        if not overwrite:
            raise RunDirInUse(
                f"trainer.resume={resume} into run directory {run_dir}, which holds a run ({', '.join(prior)}) but no "
                "complete checkpoint of it to continue: its records would mix with a run from another start; "
                "use trainer.overwrite=true to replace them, or another directory (hydra.run.dir=...)")
    if overwrite:
        for name in prior:
            path = os.path.join(run_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        return
    raise RunDirInUse(
        f"run directory {run_dir} already holds a run ({', '.join(prior)}); resume it with trainer.resume=auto, "
        "replace it with trainer.overwrite=true, or give another directory (hydra.run.dir=...)")

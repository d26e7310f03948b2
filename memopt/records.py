"""Who owns a run directory: the run id stamped on every record, and the refusal to mix two runs.

A run directory holds one run's records (``metrics.jsonl``, ``summary.json``, ``model.pt``,
``checkpoints/``). Starting a second run into it would interleave the metrics and silently replace
the summary and the weights, so it is refused unless the new run resumes the old one
(``trainer.resume``: its records are appended, each carrying the new attempt's ``run_id``) or is told
to start over (``trainer.overwrite=true``: the old records are removed first). A summary alone of a job
that trained nothing (refused at the gate, or plan mode) is no run: the next command replaces it.
"""
from __future__ import annotations

import os
import secrets
import shutil
import time

from memopt.errors import ConfigError

RECORDS = ("metrics.jsonl", "summary.json", "model.pt", "checkpoints")  # what a run leaves in its directory
HYDRA_DIR = ".hydra"  # Hydra writes the job's config here before memopt runs, also for a run it will refuse
KEPT_HYDRA = os.path.join(".memopt", "hydra")  # the owning run's copy, put back when a later run is refused


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
    if prior == ["summary.json"] and _trained_nothing(run_dir):  # a refusal's or a plan's record alone: the
        os.remove(os.path.join(run_dir, "summary.json"))  # command that replaces it owns the directory
        prior = []
    if not prior:
        _keep_hydra_record(run_dir)
        return
    if resume:
        from memopt.checkpoint import complete

        if complete(run_dir):  # the new attempt continues this directory's own run
            _keep_hydra_record(run_dir)
            return
        if not overwrite:
            _restore_hydra_record(run_dir)
            raise RunDirInUse(
                f"trainer.resume={resume} into run directory {run_dir}, which holds a run ({', '.join(prior)}) but no "
                "complete checkpoint of it to continue: its records would mix with a run from another start; "
                "use trainer.overwrite=true to replace them, or another directory (hydra.run.dir=...)")
    if overwrite:
        for name in prior:
            path = os.path.join(run_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        _keep_hydra_record(run_dir)
        return
    _restore_hydra_record(run_dir)
    raise RunDirInUse(
        f"run directory {run_dir} already holds a run ({', '.join(prior)}); resume it with trainer.resume=auto, "
        "replace it with trainer.overwrite=true, or give another directory (hydra.run.dir=...)")


def _trained_nothing(run_dir: str) -> bool:
    """The directory's summary records a job that trained nothing: refused before its ranks started, or plan
    mode. A user who fixes the refused command (or trains what was planned) and runs it again into the same
    ``hydra.run.dir`` was told the directory "already holds a run" and to resume it, which has nothing to
    resume; a failed or stopped run (``oom`` at build included) keeps its record."""
    from memopt.outcome import read

    summary = read(run_dir) or {}
    return (_no_run(summary) and "previous" not in summary) or summary.get("mode") == "plan"


def _no_run(summary: dict) -> bool:
    """A command's record that trained nothing: refused, or stopped while planning before its ranks started."""
    return summary.get("status") == "refused" or bool(summary.get("before_ranks"))


def run_record(summary: dict | None) -> dict | None:
    """The record of the run a directory holds: a command's that trained nothing (``_no_run``) keeps the run's under
    ``previous``, so the innermost record that is a run's; None if none is."""
    while summary is not None and _no_run(summary):
        summary = summary.get("previous")
    return summary


def _keep_hydra_record(run_dir: str) -> None:
    """Copy the job's ``.hydra/`` files (what this run was asked to run) beside its records."""
    src, dst = os.path.join(run_dir, HYDRA_DIR), os.path.join(run_dir, KEPT_HYDRA)
    if os.path.isdir(src):
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)


def _restore_hydra_record(run_dir: str) -> None:
    """A refused run: Hydra has already rewritten ``.hydra/`` with the refused command; put the owning
    run's files back, so that the directory (and the report's labels) still describe the run it holds."""
    kept, live = os.path.join(run_dir, KEPT_HYDRA), os.path.join(run_dir, HYDRA_DIR)
    if os.path.isdir(kept):
        shutil.rmtree(live, ignore_errors=True)
        shutil.copytree(kept, live)

"""The ranks of a job the gate let through: local ranks started here (with the watchdog), this
process's own rank, or one rank of an external launcher; and, when they fail, what the launcher adds
to their record (which rank failed or stalled, why) and how it says so.

Hydra and the exit code stay in ``train.py``; the ranks' own loop is ``trainer.py`` (``worker.py`` for
a spawned rank).
"""
from __future__ import annotations

import os
import sys

from omegaconf import OmegaConf

from memopt import outcome
from memopt.errors import EXIT_CODES
from memopt.parallel import under_launcher
from memopt.watchdog import WATCHED_BY_LAUNCHER


def start(typed, cfg, run_dir: str, group: str | None) -> dict | None:
    """Run the job; returns this process's summary (rank 0's when it starts the ranks itself)."""
    from memopt.trainer import Trainer

    resolved = OmegaConf.to_container(cfg, resolve=True)
    nproc = typed.trainer.nproc_per_node
    if nproc > 1 and not under_launcher():
        return _launch_ranks(nproc, resolved, run_dir, group)
    if under_launcher():  # external torchrun: every rank uses rank 0's run directory
        run_dir = _shared_run_dir(typed, run_dir)
    return Trainer(typed, run_dir, resolved, group=group).run()


def failure(e: Exception, run_dir: str) -> dict:
    """The record of a job whose ranks failed (written by them or by the launch), said in one line."""
    import traceback

    from memopt.config import ConfigError
    from memopt.errors import Recorded, RunStopped, WriteError
    from memopt.parallel import RankFailure

    # a refusal's, a failed save's or an out-of-memory's one-line reason is the message (the out-of-memory's
    # traceback is in summary.json), a crashed rank's traceback was printed by the launch (HYDRA_FULL_ERROR=1 shows
    # this process's traceback too)
    import torch

    quiet = (RunStopped, ConfigError, WriteError, RankFailure, torch.OutOfMemoryError)
    if not isinstance(e, quiet) or os.environ.get("HYDRA_FULL_ERROR") == "1":
        traceback.print_exc()
    status = outcome.recorded_status(run_dir)
    what = str(e) if isinstance(e, Recorded) else f"{type(e).__name__}: {e}"
    print(f"memopt: run {status} ({what}); summary in {run_dir}/summary.json", file=sys.stderr)
    return {"status": status, "error": str(e)}


def _summary_so_far(run_dir: str, resolved: dict) -> dict:
    """What the ranks recorded in summary.json, over the job's identity (a rank that stopped before
    its Trainer started wrote nothing)."""
    from memopt.sweep import job_identity

    return {**job_identity(OmegaConf.create(resolved)), **(outcome.read(run_dir) or {})}


def _launch_ranks(nproc: int, resolved: dict, run_dir: str, group: str | None) -> dict:
    """Start ``nproc`` local ranks; on failure record which rank failed and why, then re-raise."""
    from memopt.errors import Interrupted
    from memopt.parallel import RankFailure, launch
    from memopt.worker import run_rank

    watchdog = _watch_ranks(run_dir, resolved["trainer"].get("watchdog_s") or 0)
    outcome.clear_rank_stops(run_dir, nproc)  # a previous attempt's
    try:
        results = launch(nproc, run_rank, resolved, run_dir, group)
    except Interrupted as e:  # the launcher's signal is the cause; what rank 0 recorded of its stop stays beside it
        summary = _summary_so_far(run_dir, resolved)
        ranks = summary.get("error") if summary.get("status") == "interrupted" else None
        summary.update(status="interrupted", error=str(e) + (f" (rank 0: {ranks})" if ranks else ""))
        outcome.record(run_dir, summary)
        raise
    except RankFailure as e:
        summary = _summary_so_far(run_dir, resolved)
        recorded = summary.get("status")  # what the ranks decided (oom, refused, diverged, interrupted)
        stops = outcome.rank_stops(run_dir, nproc)
        if stops and recorded in (None, "failed"):  # rank 0 failed on what another rank's stop left it (a closed peer)
            r, stop = min(stops.items())
            from memopt.errors import Recorded

            summary.update(status=stop["status"], error=f"rank {r}: {stop['error']}", failed_rank=r,
                           **({"rank0_error": summary["error"]} if summary.get("error") else {}))
            outcome.record(run_dir, summary)
            raise Recorded(stop["status"], summary["error"]) from None
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
            outcome.record(run_dir, summary)
            raise Stalled(watchdog.fired[1]) from None
        outcome.record(run_dir, summary)
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

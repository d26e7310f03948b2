"""The function each launched rank runs (module level so that spawned processes can import it)."""
from __future__ import annotations

import os


def _maybe_inject_fault() -> None:
    """MEMOPT_FAULT_RANK=r makes rank r raise at start-up: how the tests check that one rank's
    crash brings the others down and is reported with its rank and cause."""
    want = os.environ.get("MEMOPT_FAULT_RANK")
    if want is not None and int(want) == int(os.environ.get("RANK", "0")):
        raise RuntimeError(f"injected fault on rank {want} (MEMOPT_FAULT_RANK)")


def run_rank(cfg_container: dict, run_dir: str, group: str | None) -> dict | None:
    """Build the typed config, join the process group and train; rank 0 returns the summary."""
    import torch
    from omegaconf import OmegaConf

    from memopt.config import TrainConfig
    from memopt.parallel import teardown
    from memopt.trainer import Trainer

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg_container))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if cfg.trainer.num_threads == 0 and not torch.cuda.is_available():
        # ranks sharing a CPU split its cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    try:
        _maybe_inject_fault()
        summary = Trainer(cfg, run_dir, cfg_container, group=group).run()
    except Exception as e:
        _exit_if_recorded(e)
        raise
    finally:
        teardown()
    return summary if int(os.environ.get("RANK", "0")) == 0 else None


def _exit_if_recorded(e: Exception) -> None:
    """A rank that stops with an outcome of its own (a refusal, an out-of-memory, a divergence, a signal,
    a checkpoint that could not be written) exits with that status's code and no traceback: rank 0 has
    recorded it in summary.json (traceback included) and the launcher says it in one line. Anything else
    is raised, so the launcher can print the rank's traceback."""
    from memopt.errors import EXIT_CODES, WriteError, status_of

    status = status_of(e)
    if status != "failed" or isinstance(e, WriteError):
        raise SystemExit(EXIT_CODES[status])


def run_many(jobs: list[tuple[dict, str]]) -> list[dict] | None:
    """Run several jobs one after another in the same ranks (one process group for all);
    rank 0 returns their summaries. Used by tests and benchmarks to avoid a launch per job."""
    import torch
    from omegaconf import OmegaConf

    from memopt.config import TrainConfig
    from memopt.parallel import teardown
    from memopt.trainer import Trainer

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    out = []
    try:
        for container, run_dir in jobs:
            cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), container))
            out.append(Trainer(cfg, run_dir, container).run())
    finally:
        teardown()
    return out if int(os.environ.get("RANK", "0")) == 0 else None

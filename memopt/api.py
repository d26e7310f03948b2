"""Programmatic entry points: compose a config as the CLI would and run it in this process.

Used by the benchmarks under ``experiments/`` and by the tests, so that they exercise exactly the
configuration path of ``python -m memopt.train``.
"""
from __future__ import annotations

from omegaconf import OmegaConf

from memopt.config import compose_config  # noqa: F401 - part of the programmatic entry points


def run_job(overrides: list[str], run_dir: str) -> dict:
    """Validate and run one job in this process; returns its summary (raises on failure). ``+strategy=auto``
    runs the composition it chooses, as the CLI does."""
    from memopt.config import to_dataclass, validate
    from memopt.errors import ConfigError
    from memopt.planner.balance import resolve_split
    from memopt.trainer import Trainer

    cfg = compose_config(overrides)
    typed = to_dataclass(cfg, overrides)
    validate(typed)
    if "auto" in typed.strategy.selected():
        from memopt.gate import choose_composition

        chosen = choose_composition(typed, cfg, run_dir)
        if isinstance(chosen, dict):  # the refused record, written
            raise ConfigError(chosen.get("error") or "+strategy=auto: no candidate fits (the ranking is in auto.json)")
        typed, cfg, _ = chosen
    resolve_split(cfg, typed)  # split=balanced: the planner's blocks per stage, as the CLI resolves it
    return Trainer(typed, run_dir, OmegaConf.to_container(cfg, resolve=True)).run()


def run_jobs_on_ranks(nproc: int, jobs: list[tuple[list[str], str]]) -> list[dict]:
    """Run several jobs (overrides, run_dir) in one launch of ``nproc`` local ranks, in order."""
    from memopt.config import to_dataclass, validate
    from memopt.parallel import launch
    from memopt.planner.balance import resolve_split
    from memopt.worker import run_many

    containers = []
    for overrides, run_dir in jobs:
        cfg = compose_config([*overrides, f"trainer.nproc_per_node={nproc}"])  # the world the jobs run in
        typed = to_dataclass(cfg, overrides)
        validate(typed)
        resolve_split(cfg, typed)  # before the ranks start: each builds the same stages
        containers.append((OmegaConf.to_container(cfg, resolve=True), run_dir))
    return launch(nproc, run_many, containers, preloaded=True)[0]

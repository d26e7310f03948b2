"""Programmatic entry points: compose a config as the CLI would and run it in this process.

Used by the benchmarks under ``experiments/`` and by the tests, so that they exercise exactly the
configuration path of ``python -m memopt.train``.
"""
from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The DictConfig that ``python -m memopt.train <overrides>`` would run."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from memopt.config import register_configs

    register_configs()
    if GlobalHydra.instance().is_initialized():  # inside the CLI (the planner composes candidates there)
        return compose(config_name="train", overrides=list(overrides or []))
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides or []))


def run_job(overrides: list[str], run_dir: str) -> dict:
    """Validate and run one job in this process; returns its summary (raises on failure). ``+strategy=auto``
    runs the composition it chooses, as the CLI does."""
    from memopt.config import to_dataclass, validate
    from memopt.errors import ConfigError
    from memopt.trainer import Trainer

    cfg = compose_config(overrides)
    typed = to_dataclass(cfg)
    validate(typed)
    if "auto" in typed.strategy.selected():
        from memopt.train import choose_composition

        chosen = choose_composition(typed, cfg, run_dir, overrides)
        if chosen is None:
            raise ConfigError("+strategy=auto: no candidate fits (the ranking is in auto.json)")
        typed, cfg = chosen
    return Trainer(typed, run_dir, OmegaConf.to_container(cfg, resolve=True)).run()


def run_jobs_on_ranks(nproc: int, jobs: list[tuple[list[str], str]]) -> list[dict]:
    """Run several jobs (overrides, run_dir) in one launch of ``nproc`` local ranks, in order."""
    from memopt.config import to_dataclass, validate
    from memopt.parallel import launch
    from memopt.worker import run_many

    containers = []
    for overrides, run_dir in jobs:
        cfg = compose_config([*overrides, f"trainer.nproc_per_node={nproc}"])  # the world the jobs run in
        validate(to_dataclass(cfg))
        containers.append((OmegaConf.to_container(cfg, resolve=True), run_dir))
    return launch(nproc, run_many, containers)[0]

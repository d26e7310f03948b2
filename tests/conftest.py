"""Shared helpers: compose configs the way the CLI does, and run the loop in-process."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(REPO, "conf")


def compose(overrides: list[str] | None = None):
    """The DictConfig that ``python -m memopt.train <overrides>`` would run."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import memopt.train  # noqa: F401  (registers the schema)

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return hydra_compose(config_name="train", overrides=list(overrides or []))


def typed(overrides: list[str] | None = None):
    from memopt.config import to_dataclass, validate

    cfg = to_dataclass(compose(overrides))
    validate(cfg)
    return cfg


def train(overrides: list[str], run_dir: str, logger: str = "none") -> dict:
    """Run one job in this process (no progress bar, no W&B unless asked); returns summary.json."""
    from omegaconf import OmegaConf

    from memopt.trainer import Trainer

    cfg = compose([f"logger={logger}", "trainer.progress_bar=false", "trainer.save_checkpoint=false", *overrides])
    from memopt.config import to_dataclass, validate

    t = to_dataclass(cfg)
    validate(t)
    return Trainer(t, run_dir, OmegaConf.to_container(cfg, resolve=True)).run()


def losses(run_dir: str) -> list[float]:
    import json

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.fixture
def run_dir(tmp_path):
    return str(tmp_path / "run")

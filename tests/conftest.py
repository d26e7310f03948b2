"""Shared helpers: compose configs the way the CLI does, and run the loop in-process."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    import torch

    # pytest-xdist's workers share the cores: each takes its share for torch's intra-op threads. Two workers of
    # two threads each on 2 cores (one of them often running a test's 2 ranks besides) made in-process runs up
    # to 10x slower than alone (OpenMP's threads waiting on each other): the dropout-recomputation test took 41 s
    # in the suite and 4 s alone on an AVX2 CPU.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(REPO, "conf")


def compose(overrides: list[str] | None = None):
    """The DictConfig that ``python -m memopt.train <overrides>`` would run."""
    from memopt.api import compose_config

    return compose_config(overrides)


def typed(overrides: list[str] | None = None):
    from memopt.config import to_dataclass, validate

    cfg = to_dataclass(compose(overrides), list(overrides or []))
    validate(cfg)
    return cfg


def train(overrides: list[str], run_dir: str, logger: str = "none") -> dict:
    """Run one job in this process (no progress bar, no W&B unless asked); returns summary.json."""
    from memopt.api import run_job

    return run_job([f"logger={logger}", "trainer.progress_bar=false", "trainer.save_checkpoint=false", *overrides], run_dir)


def cli_main(argv: list[str]) -> int:
    """``python -m memopt.train <argv>`` in this process (the CLI's entry point, Hydra's ``.hydra/`` and
    task overrides included); returns the exit code."""
    import sys

    from hydra.core.global_hydra import GlobalHydra

    from memopt.train import main

    saved = sys.argv
    sys.argv = ["memopt.train", *argv]
    try:
        main()
        return 0
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        sys.argv = saved
        GlobalHydra.instance().clear()


def losses(run_dir: str) -> list[float]:
    import json

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.fixture
def run_dir(tmp_path):
    return str(tmp_path / "run")


def selected(request, param: str = "name") -> set:
    """Values of ``param`` among the tests of this module that the session runs (after ``-m``/``-k``):
    a module fixture that runs a matrix in one launch runs only the cases that will be checked."""
    return {item.callspec.params[param] for item in request.session.items
            if item.module is request.module and hasattr(item, "callspec") and param in item.callspec.params}


def cases(matrix: dict, slow: set) -> list:
    """``matrix``'s names as parameters, those in ``slow`` marked slow."""
    unknown = slow - set(matrix)
    assert not unknown, unknown
    return [pytest.param(n, marks=pytest.mark.slow) if n in slow else n for n in matrix]


# Every test file this session collected, before -m/-k deselection (tests/config/test_collection.py reads it
# when the session ran the whole suite, and otherwise runs the collection itself).
COLLECTED: set[str] = set()
SESSION_ARGS: list[str] = []


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    COLLECTED.update(os.path.relpath(str(item.path), REPO) for item in items)
    SESSION_ARGS[:] = [os.path.abspath(str(a).split("::")[0]) for a in config.args]

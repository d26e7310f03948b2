"""The sweep presets under conf/experiment/: each is a `_global_` package, names real config options,
and every job of its sweep composes and validates exactly as `python -m memopt.train -m` would run it."""
from __future__ import annotations

import itertools
import os

import pytest
import yaml

from tests.conftest import CONF, typed

PRESETS = ["strategies", "zero", "vs_deepspeed", "chunk", "moe", "report_demo"]


def _load(name: str) -> tuple[str, dict]:
    with open(os.path.join(CONF, "experiment", f"{name}.yaml")) as f:
        text = f.read()
    return text, yaml.safe_load(text)


def sweep_jobs(params: dict) -> list[list[str]]:
    """The override lists of every job, expanded by Hydra's own override parser (as BasicSweeper does)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    axes = []
    for key, value in params.items():
        (ov,) = parser.parse_overrides([f"{key}={value}"])
        axes.append([f"{ov.get_key_element()}={v}" for v in ov.sweep_string_iterator()])
    return [list(job) for job in itertools.product(*axes)]


@pytest.mark.parametrize("name", PRESETS)
def test_preset_is_global_and_sweeps(name):
    text, data = _load(name)
    assert text.startswith("# @package _global_")
    assert data["experiment"] == name  # the W&B group of every job
    assert data["hydra"]["sweeper"]["params"], name


@pytest.mark.parametrize("name", PRESETS)
def test_preset_composes_with_its_sweeper_params(name):
    from hydra import compose, initialize_config_dir

    from memopt.api import compose_config

    compose_config([])  # registers the structured schemas the config tree refers to
    _, data = _load(name)
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"experiment={name}"], return_hydra_config=True)
    assert dict(cfg.hydra.sweeper.params) == {k: str(v) for k, v in data["hydra"]["sweeper"]["params"].items()}
    assert name in cfg.hydra.sweep.dir
    assert "memopt.sweep.SweepReport" in str(cfg.hydra.callbacks)


@pytest.mark.parametrize("name", PRESETS)
def test_every_job_of_the_preset_is_valid(name):
    _, data = _load(name)
    jobs = sweep_jobs(data["hydra"]["sweeper"]["params"])
    assert len(jobs) >= 2
    for job in jobs:
        cfg = typed([f"experiment={name}", *job])  # unknown option, wrong field or refused combination raises
        assert cfg.experiment == name


def test_vs_deepspeed_is_the_engine_by_stage_matrix():
    _, data = _load("vs_deepspeed")
    jobs = sweep_jobs(data["hydra"]["sweeper"]["params"])
    pairs = {(dict(o.split("=", 1) for o in j)["engine"], dict(o.split("=", 1) for o in j)["+strategy"]) for j in jobs}
    assert pairs == {(e, s) for e in ("memopt", "deepspeed", "fsdp2") for s in ("zero2", "zero3")}


def test_zero_preset_runs_two_ranks():
    assert typed(["experiment=zero", "+strategy=zero3"]).trainer.nproc_per_node == 2

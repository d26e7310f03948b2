"""Sweeps through hydra-submitit-launcher's local executor: the code path a SLURM sweep takes
(hydra/launcher=memopt_slurm), with jobs as separate processes on this machine."""
from __future__ import annotations

import os

import pytest

from tests.report.helpers import run_module, summaries

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
ARGS = ["logger=none", "trainer.max_steps=3", "trainer.eval_every=0", "trainer.progress_bar=false",
        "trainer.save_checkpoint=false", "trainer.throughput_warmup_steps=1"]


@pytest.mark.slow  # 20 s (two jobs through submitit's executor); the default suite checks the SLURM preset's config
def test_two_job_sweep_with_the_submitit_local_executor(tmp_path):
    sweep = str(tmp_path / "sub")
    proc = run_module("memopt.train", ["-m", "hydra/launcher=submitit_local", f"hydra.sweep.dir={sweep}", *ARGS,
                                       "+strategy=ckpt,[]"], cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = summaries(sweep)
    assert sorted(s["strategy"] == [] for s in jobs.values()) == [False, True]
    assert all(s["status"] == "ok" and s["world_size"] == 1 for s in jobs.values())
    assert os.path.isdir(os.path.join(sweep, ".submitit"))  # the jobs ran through submitit
    assert os.path.exists(os.path.join(sweep, "report.html"))


@pytest.mark.slow
def test_each_submitit_task_is_a_rank(tmp_path):
    """tasks_per_node=2: every job is 2 processes that become ranks 0 and 1 of one 2-rank run."""
    sweep = str(tmp_path / "ranks")
    proc = run_module("memopt.train", ["-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2",
                                       f"hydra.sweep.dir={sweep}", *ARGS, "+strategy=zero2,zero3"], cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = summaries(sweep)
    assert len(jobs) == 2 and all(s["status"] == "ok" and s["world_size"] == 2 for s in jobs.values())
    assert all(set(s["peak_bytes"]) == {"0", "1"} for s in jobs.values())


def test_slurm_preset_is_a_multi_node_job():
    from hydra import compose, initialize_config_dir

    from memopt.api import compose_config
    from tests.conftest import CONF

    compose_config([])
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["hydra/launcher=memopt_slurm", "hydra.launcher.nodes=4",
                                                      "hydra.launcher.tasks_per_node=8"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (4, 8, 8)  # one task per GPU
    assert cfg.trainer.nproc_per_node == 1  # SLURM starts the ranks

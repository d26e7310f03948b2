"""Resumable checkpoints with tensor parallelism: 6 steps straight vs 3 + resume 3 (the helpers of
tests/e2e/test_resume.py), losses and final weights bit-identical. The reference is the straight run
(its in-memory state continues); the resumed run rebuilds everything from the files, so a split
parameter loaded into another rank's rows, or one tp rank's optimizer state read by the other, shows
as a different loss at step 3.

A checkpoint written with another ``parallel.tp`` or another ``strategy.tp.form`` is refused before
the run starts (meta.json's identity: the mesh sizes and the strategies' options).
"""
from __future__ import annotations

import json

import pytest

from memopt.parallel.launch import RankFailure
from tests.e2e.test_resume import DENSE, assert_exact, pair

TP = ["parallel.tp=2"]
TWO_RANKS = {  # tp=2 on 2 ranks: the memopt engine's stages run their code paths over a dp of 1
    "megatron_ddp": ["+strategy=[tp,ddp]"],
    "sp_lp_zero1": ["+strategy=[tp,zero1]", "strategy.tp.sequence_parallel=true", "strategy.tp.loss_parallel=true"],
    "all_gather_zero2": ["+strategy=[tp,zero2]", "strategy.tp.form=all_gather"],
    "sp_zero3_ckpt": ["+strategy=[tp,zero3,ckpt]", "strategy.tp.sequence_parallel=true"],
}
FOUR_RANKS = {  # tp=2 x dp_shard=2: shards of tp-local tensors
    "zero3": ["+strategy=[tp,zero3]"],
    "fsdp2_zero2_sp": ["engine=fsdp2", "+strategy=[tp,zero2]", "strategy.tp.sequence_parallel=true"],
    "fsdp2_zero3_lp": ["engine=fsdp2", "+strategy=[tp,zero3]", "strategy.tp.loss_parallel=true"],
}


def _jobs(root, matrix: dict) -> list:
    return [j for name, o in matrix.items() for j in pair(root, name, [*DENSE, *TP, *o])]


def _run_exact(root, matrix: dict, world: int) -> list:
    """Every pair of ``matrix`` (straight, 3 + resume 3) on ``world`` ranks, each bit-exact; the jobs."""
    from memopt.api import run_jobs_on_ranks

    jobs = _jobs(root, matrix)
    run_jobs_on_ranks(world, jobs)
    for i in range(0, len(jobs), 2):
        assert_exact(jobs[i : i + 2])
    return jobs


def _refused(run_dir: str, jobs_overrides: list[str], change: list[str]) -> str:
    """Resume ``jobs_overrides``' checkpoint with ``change``: the job must be refused; its message."""
    from memopt.api import run_jobs_on_ranks

    with pytest.raises(RankFailure):
        run_jobs_on_ranks(2, [([*jobs_overrides, *change], run_dir)])
    with open(f"{run_dir}/summary.json") as f:
        s = json.load(f)
    assert s["status"] == "refused", s
    return s["error"]


@pytest.mark.slow
def test_resume_is_exact_tp2_two_ranks(tmp_path):
    jobs = _run_exact(tmp_path, TWO_RANKS, 2)
    # another form, or no tensor parallelism: refused, naming what differs
    resumed = jobs[1][0]
    err = _refused(str(tmp_path / "form"), resumed, ["strategy.tp.form=all_gather"])
    assert "cannot resume this run" in err and "strategy_options" in err, err
    plain = [o for o in resumed if o not in TP and not o.startswith("+strategy")] + ["+strategy=ddp"]
    err = _refused(str(tmp_path / "no_tp"), plain, [])
    assert "cannot resume this run" in err and "parallel" in err, err


@pytest.mark.slow
def test_resume_is_exact_tp2_x_dp2(tmp_path):
    _run_exact(tmp_path, FOUR_RANKS, 4)

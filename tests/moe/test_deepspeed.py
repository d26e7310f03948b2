"""DeepSpeed-MoE as the baseline of ``+strategy=moe`` (``engine=deepspeed``, ``deepspeed.moe.layer.MoE``
holding the weights memopt's layers were given). DeepSpeed is the independent reference: its gate,
dispatch (dense einsums), all_to_all and expert-data-parallel reduction are its own code.

With a capacity factor that drops nothing (the one gating difference is which tokens an over-full
expert drops, see ``memopt/engines/deepspeed_moe.py``) the two engines compute the same function in
fp32 with a different summation order: the loss trajectories agree to 1e-6 relative. DeepSpeed's
stage 0 (``ddp``) clips an MoE run with a norm over the rank's own experts only (lower than the
global norm that memopt and DeepSpeed's ZeRO use), so the ddp comparison runs without clipping."""
from __future__ import annotations

import pytest

from memopt.api import run_jobs_on_ranks
from memopt.errors import ConfigError
from tests.conftest import losses, train, typed

BASE = ["model=moe_tiny", "model.seq_len=32", "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_every=0",
        "trainer.micro_batch_size=2", "optim.lr=3e-3", "optim.warmup_steps=0", "strategy.moe.capacity_factor=4.0",
        "logger=none", "trainer.progress_bar=false", "trainer.save_checkpoint=false"]
TOL = 1e-6


def rel_err(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.slow  # the default suite runs zero2 + moe with ep=2 in tests/distributed/test_deepspeed_engine.py
def test_deepspeed_moe_follows_memopt_single_process(tmp_path):
    got = {}
    for engine in ("memopt", "deepspeed"):
        s = train([*BASE, f"engine={engine}"], str(tmp_path / engine))
        assert s["status"] == "ok" and s["engine"] == engine
        got[engine] = losses(str(tmp_path / engine))
        assert len(got[engine]) == 3
    assert got["memopt"][-1] < got["memopt"][0]  # it trains
    assert rel_err(got["deepspeed"], got["memopt"]) <= TOL, got


# name -> 2-rank overrides (each run on both engines)
MATRIX = {
    "ddp_ep2": ["+strategy=ddp", "parallel.ep=2", "optim.grad_clip=0"],
    "zero2_ep2": ["+strategy=zero2", "parallel.ep=2"],
    "zero1_ep1_top2": ["+strategy=zero1", "strategy.moe.top_k=2"],
    "zero2_ep2_dropless": ["+strategy=zero2", "parallel.ep=2", "strategy.moe.drop_tokens=false"],
}


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsmoe")
    jobs = [([*BASE, *ov, f"engine={e}"], str(root / f"{n}_{e}")) for n, ov in MATRIX.items() for e in ("memopt", "deepspeed")]
    run_jobs_on_ranks(2, jobs)
    return {(n, e): losses(str(root / f"{n}_{e}")) for n in MATRIX for e in ("memopt", "deepspeed")}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MATRIX))
def test_deepspeed_moe_follows_memopt_on_two_ranks(two_rank, name):
    ref, got = two_rank[(name, "memopt")], two_rank[(name, "deepspeed")]
    assert len(got) == len(ref) == 3
    assert rel_err(got, ref) <= TOL, (name, got, ref)


@pytest.mark.parametrize("overrides,needle", [
    (["+strategy=zero3"], "DeepSpeed-MoE is not supported with ZeRO stage 3"),
    (["strategy.moe.num_experts=4", "strategy.moe.top_k=3"], "strategy.moe.top_k=3 with engine=deepspeed"),
    (["strategy.moe.min_capacity=100", "trainer.micro_batch_size=1", "model.seq_len=64"],
     "strategy.moe.min_capacity=100 is larger than the 64 tokens"),
])
def test_deepspeed_moe_refusals(overrides, needle):
    with pytest.raises(ConfigError) as e:
        typed(["model=moe_tiny", "engine=deepspeed", *overrides])
    assert needle in str(e.value)

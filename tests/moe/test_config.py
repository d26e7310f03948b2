"""``+strategy=moe`` configs: bad input refused at validation (before any allocation) naming the field
and the fix; the presets select the strategy; parameter and FLOP counts from the config agree with
the composed model (FLOPs: only the active experts)."""
from __future__ import annotations

import pytest
import torch

from memopt import compose
from memopt.errors import ConfigError
from memopt.parallel.dims import ParallelDims
from tests.conftest import typed


@pytest.mark.parametrize("overrides,needle", [
    (["strategy.moe.num_experts=3", "parallel.ep=2", "trainer.nproc_per_node=2"], "strategy.moe.num_experts=3 is not divisible by parallel.ep=2"),
    (["strategy.moe.top_k=5"], "strategy.moe.top_k=5 must be between 1 and strategy.moe.num_experts=4"),
    (["strategy.moe.capacity_factor=0"], "strategy.moe.capacity_factor=0.0 must be > 0"),
    (["strategy.moe.eval_capacity_factor=-1"], "strategy.moe.eval_capacity_factor=-1.0 must be > 0"),
    (["strategy.moe.every_k_layers=9"], "strategy.moe.every_k_layers=9 must be between 1 and model.n_layer=4"),
    (["strategy.moe.min_capacity=0"], "strategy.moe.min_capacity=0 must be >= 1"),
    (["strategy.moe.aux_loss_coef=-0.1"], "strategy.moe.aux_loss_coef=-0.1 must be >= 0"),
    (["parallel.ep=3", "trainer.nproc_per_node=2"], "parallel.ep=3 does not divide"),
])
def test_bad_input_is_refused_naming_field_and_fix(overrides, needle):
    with pytest.raises(ConfigError, match=None) as e:
        typed(["model=gpt_tiny", "+strategy=moe", *overrides])
    assert needle in str(e.value)


def test_engines_without_moe_refuse_it():
    with pytest.raises(ConfigError, match="strategy moe has no"):
        typed(["+strategy=[moe,zero2]", "engine=fsdp2"])


@pytest.mark.parametrize("model", ["moe_tiny", "moe_small"])
def test_presets_select_moe_and_counts_match_the_model(model):
    cfg = typed([f"model={model}", "+strategy=zero2"])
    assert cfg.strategy.selected() == ["moe", "zero2"] or set(cfg.strategy.selected()) == {"moe", "zero2"}
    m = compose.model_on_meta(cfg, torch.device("cpu"), ParallelDims(), None)
    params = {id(p): p for p in m.parameters()}.values()
    assert compose.num_params(cfg) == sum(p.numel() for p in params)
    mc, o = cfg.model, cfg.strategy.moe
    idle = sum(p.numel() for n, p in m.named_parameters()
               if ".experts." in n and int(n.split(".experts.")[1].split(".")[0]) >= o.top_k)  # E - k experts per layer
    assert compose.active_params(cfg) == compose.num_params(cfg) - idle  # what a token meets
    active = compose.num_params(cfg) - idle - mc.seq_len * mc.d_model  # no matmul with the position table
    assert compose.flops_per_token(cfg) == 6.0 * active + 12.0 * mc.n_layer * mc.d_model * mc.seq_len


def test_moe_blocks_and_init_names():
    cfg = typed(["model=moe_tiny"])
    m = compose.model_on_meta(cfg, torch.device("cpu"), ParallelDims(), None)
    names = [n for n, _ in m.named_parameters()]
    assert "blocks.0.mlp.fc.weight" in names and "blocks.1.mlp.router.weight" in names
    assert "blocks.3.mlp.experts.3.proj.weight" in names and "blocks.2.mlp.fc.weight" in names
    from memopt.models.gpt import init_tensor

    resid = init_tensor("blocks.3.mlp.experts.3.proj.weight", (128, 512), 0, cfg.model).std()
    fc = init_tensor("blocks.3.mlp.experts.3.fc.weight", (512, 128), 0, cfg.model).std()
    assert resid == pytest.approx(0.02 / (2 * 4) ** 0.5, rel=0.02) and fc == pytest.approx(0.02, rel=0.02)


def test_expert_parallel_refusals():
    with pytest.raises(ConfigError, match=r"parallel.ep=2 is not supported without a strategy .*\+strategy=moe"):
        typed(["trainer.nproc_per_node=2", "parallel.ep=2", "trainer.save_checkpoint=false"])
    typed(["model=moe_tiny", "trainer.nproc_per_node=2", "parallel.ep=2", "+strategy=zero3", "trainer.save_checkpoint=false"])
    with pytest.raises(ConfigError, match="parallel.ep=2 with strategy cpu_offload is not built"):
        typed(["model=moe_tiny", "trainer.nproc_per_node=2", "parallel.ep=2", "+strategy=[zero2,cpu_offload]"])
    typed(["model=moe_tiny", "trainer.nproc_per_node=2", "parallel.ep=2", "trainer.checkpoint_every=1"])  # model.pt, checkpoints
    # the chunk engine keeps each rank's expert chunks to itself (tests/moe/test_chunk.py)
    typed(["model=moe_tiny", "trainer.nproc_per_node=2", "parallel.ep=2", "+strategy=chunk", "trainer.save_checkpoint=false"])
    cfg = typed(["model=moe_tiny", "trainer.nproc_per_node=2", "parallel.ep=2", "+strategy=zero2", "trainer.save_checkpoint=false"])
    assert cfg.parallel.ep == 2

"""Named parallel dimensions: sizes, refusals with the numbers, and the process groups of a real
4-rank gloo mesh against the layout DeepSpeed-MoE and Megatron use (tp innermost, expert groups of
consecutive data-parallel ranks)."""
from __future__ import annotations

import pytest

from memopt.errors import ConfigError
from memopt.parallel.dims import ParallelConfig, resolve_sizes
from tests.conftest import typed


@pytest.mark.parametrize("cfg, world, want", [
    (ParallelConfig(), 1, {"pp": 1, "dp_replicate": 1, "dp_shard_mod_ep": 1, "ep": 1, "tp": 1}),
    (ParallelConfig(), 8, {"pp": 1, "dp_replicate": 1, "dp_shard_mod_ep": 8, "ep": 1, "tp": 1}),
    (ParallelConfig(tp=2), 8, {"pp": 1, "dp_replicate": 1, "dp_shard_mod_ep": 4, "ep": 1, "tp": 2}),
    (ParallelConfig(dp_replicate=2, ep=2), 8, {"pp": 1, "dp_replicate": 2, "dp_shard_mod_ep": 2, "ep": 2, "tp": 1}),
    (ParallelConfig(dp_replicate=2, dp_shard=2, tp=2), 8, {"pp": 1, "dp_replicate": 2, "dp_shard_mod_ep": 2, "ep": 1, "tp": 2}),
    (ParallelConfig(pp=2, tp=2), 8, {"pp": 2, "dp_replicate": 1, "dp_shard_mod_ep": 2, "ep": 1, "tp": 2}),
])
def test_sizes_fill_the_world(cfg, world, want):
    got = resolve_sizes(cfg, world)
    assert got == want
    assert got["pp"] * got["dp_replicate"] * got["dp_shard_mod_ep"] * got["ep"] * got["tp"] == world


@pytest.mark.parametrize("cfg, world, words", [
    (ParallelConfig(dp_shard=3), 2, ["dp_shard=3", "= 3 ranks", "world has 2"]),
    (ParallelConfig(tp=3), 2, ["parallel.tp=3", "does not divide the world size 2"]),
    (ParallelConfig(ep=4), 6, ["parallel.ep=4", "dp_shard=6", "[1, 2, 3, 6]"]),
    (ParallelConfig(tp=0), 2, ["parallel.tp=0", ">= 1"]),
    (ParallelConfig(dp_shard=0), 2, ["parallel.dp_shard=0"]),
    (ParallelConfig(pp=3), 4, ["parallel.pp=3", "does not divide the world size 4"]),
    (ParallelConfig(pp=2, dp_shard=4), 4, ["pp=2 x dp_replicate=1 x dp_shard=4", "world has 4"]),
])
def test_impossible_sizes_are_refused_with_the_numbers(cfg, world, words):
    with pytest.raises(ConfigError) as e:
        resolve_sizes(cfg, world)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("overrides, words", [
    (["trainer.nproc_per_node=2", "parallel.dp_shard=4"], ["dp_shard=4", "world has 2"]),
    (["trainer.nproc_per_node=2", "parallel.tp=2"], ["parallel.tp=2", "not supported without a strategy", "+strategy=tp"]),
    (["trainer.nproc_per_node=2", "parallel.ep=2"], ["parallel.ep=2", "not supported"]),
    (["trainer.nproc_per_node=2", "parallel.dp_replicate=2", "+strategy=zero2"], ["parallel.dp_replicate=2", "engine=fsdp2"]),
    (["trainer.nproc_per_node=2", "parallel.dp_replicate=2", "+strategy=zero2", "engine=deepspeed"], ["parallel.dp_replicate=2", "DeepSpeed"]),
    (["trainer.nproc_per_node=2", "parallel.tp=2", "+strategy=chunk"], ["parallel.tp=2", "chunk engine"]),
])
def test_the_config_refuses_unsupported_dimensions_before_allocating(overrides, words):
    with pytest.raises(ConfigError) as e:
        typed(overrides)
    for w in words:
        assert w in str(e.value)


def test_fsdp2_accepts_a_replicate_dimension():
    cfg = typed(["trainer.nproc_per_node=2", "parallel.dp_replicate=2", "engine=fsdp2", "+strategy=zero3"])
    assert cfg.parallel.dp_replicate == 2


def groups_of_this_rank(parallel: dict) -> dict:
    """(In each of 4 ranks.) The global ranks of every named dimension's group, and this rank's coordinate."""
    import torch
    import torch.distributed as dist

    from memopt.parallel import setup, teardown

    dims = setup(torch.device("cpu"), ParallelConfig(**parallel))
    try:
        out = {}
        for name, d in dims.dims.items():
            ranks = dist.get_process_group_ranks(d.group) if d.group is not None else [dist.get_rank()]
            t = torch.tensor([float(dist.get_rank())])
            d.all_reduce_(t)  # the sum of the group's global ranks: proves the collective uses that group
            out[name] = (ranks, d.rank, d.size, t.item())
        return out
    finally:
        teardown()


@pytest.mark.slow  # 4 processes on 2 cores; the 2-rank group tests run by default
def test_four_ranks_form_the_documented_groups():
    from memopt.parallel import launch

    # tp innermost (consecutive ranks), dp across them (Megatron's layout)
    res = launch(4, groups_of_this_rank, {"tp": 2})
    for r in range(4):
        g = res[r]
        assert g["tp"][0] == [r - r % 2, r - r % 2 + 1] and g["tp"][1] == r % 2
        assert g["dp"][0] == [r % 2, r % 2 + 2] and g["dp"][2] == 2 and g["dp_shard"][0] == g["dp"][0]
        assert g["tp"][3] == sum(g["tp"][0]) and g["dp"][3] == sum(g["dp"][0])
        assert g["ep"][2] == 1 and g["world"][0] == [0, 1, 2, 3]
    # experts over consecutive data-parallel ranks, expert-data-parallel across them (DeepSpeed-MoE)
    res = launch(4, groups_of_this_rank, {"ep": 2})
    for r in range(4):
        g = res[r]
        assert g["ep"][0] == [r - r % 2, r - r % 2 + 1] and g["edp"][0] == [r % 2, r % 2 + 2]
        assert g["dp"][0] == [0, 1, 2, 3] and g["ep"][3] == sum(g["ep"][0]) and g["edp"][3] == sum(g["edp"][0])
    # pipeline stages outermost: a pipeline spans the far ranks, each stage's data parallelism the near ones
    res = launch(4, groups_of_this_rank, {"pp": 2})
    for r in range(4):
        g = res[r]
        assert g["pp"][0] == [r % 2, r % 2 + 2] and g["pp"][1] == r // 2 and g["pp"][3] == sum(g["pp"][0])
        assert g["dp"][0] == [r - r % 2, r - r % 2 + 1] and g["dp_shard"][0] == g["dp"][0] and g["dp"][3] == sum(g["dp"][0])

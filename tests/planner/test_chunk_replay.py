"""The chunk engine planned by replaying a recorded shallow step at the planned depth
(``planner/engines/chunk/replay.py``) against the simulation of every block (the reference: the run's code on
fake tensors at the full depth): byte for byte, per rank, memory and category, and the same FLOPs,
link traffic and collectives. The models have chunks of ~2.5 blocks dealt to 2-4 ranks, so a rank
owns several chunk groups and its layout changes every few blocks: no shallow window follows it."""
from __future__ import annotations

import pytest

from tests.conftest import typed

COMMON = ["model=gpt_tiny", "model.seq_len=64", "trainer.micro_batch_size=2", "logger=none",
          "strategy.chunk.chunk_size=496640"]  # one gpt_tiny block is 198,272 parameters
FAST = ["trainer.eval_every=0", "trainer.save_checkpoint=false"]


def same_as_full_depth(overrides: list[str], world: int, ranks, verify: bool = True) -> list[str]:
    from memopt.planner.extrapolate import simulate
    from memopt.planner.simulate import simulate_rank

    cfg = typed([*COMMON, *overrides, f"trainer.nproc_per_node={world}"])
    methods = []
    for i, rank in enumerate(ranks):  # as plan.py does: the first rank checks, the next replay its recording
        got = simulate(cfg, rank, world, replay=5, verify=verify and i == 0)
        methods.append(got["method"])
        full = simulate_rank(cfg, rank, world)
        for key in ("peaks", "flops", "traffic", "comm_per_step"):
            assert got[key] == full[key], (rank, key, got[key], full[key])
        assert got["engine_metrics"] == full["engine_metrics"], rank
    return methods


def test_layout_that_no_shallow_window_follows_is_replayed_exactly():
    from memopt.planner.engines.chunk.depth import layout, window_check
    from memopt.planner.extrapolate import at_depth

    overrides = ["+strategy=hybrid_adam", "model.n_layer=8", *FAST]
    cfg = typed([*COMMON, *overrides, "trainer.nproc_per_node=2"])
    lays = [layout(at_depth(cfg, d), 0, 2) for d in (3, 4, 5, 8)]
    assert lays[-1]["local"] == 2 and lays[0]["local"] == 1  # rank 0 owns a chunk of two groups at depth 8, of one at 3
    assert window_check(cfg, 0, 2, (3, 4, 5, 8), {}) is not None  # what extrapolation gave up on
    method, = same_as_full_depth(overrides, 2, ranks=(0,), verify=False)
    assert method == "replayed at n_layer=8 from a recorded n_layer=5 step", method
    # both sides above run the planner; the replay is also anchored outside it: the FLOPs of a rank's
    # step against the analytic count from the shapes (test_extrapolate.analytic_flops)
    from memopt.planner.extrapolate import simulate
    from tests.planner.test_extrapolate import analytic_flops

    got = simulate(cfg, 0, 2, replay=5, verify=False)
    assert got["flops"] == pytest.approx(analytic_flops(cfg), rel=0.02)


def test_a_recording_does_not_depend_on_the_chunk_engines_options():
    """Preflight candidates that differ only in the chunk engine's options replay one recording
    (``depth.model_side``): recorded again under other options (a device budget that leaves Hybrid
    Adam no group on the device, mem_saving_comm, another warm-up ratio, the state dict, another hardware), the model side is the
    same item for item."""
    from memopt.planner.engines.chunk import replay as chunk_replay
    from memopt.planner.engines.chunk.depth import model_side

    base = [*COMMON, "+strategy=[hybrid_adam,ckpt]", "model.n_layer=5", "trainer.eval_every=1", "trainer.nproc_per_node=2"]
    a = typed([*base, "trainer.save_checkpoint=false"])
    b = typed([*base, "trainer.save_checkpoint=true", "strategy.chunk.mem_saving_comm=true", "hardware.device_memory_gb=2",
               "strategy.chunk.device_budget_gb=0.012", "strategy.chunk.warmup_gpu_chunk_mem_ratio=0.5"])
    assert model_side(a) == model_side(b)
    (ra, sa), (rb, sb) = chunk_replay.record(a, 0, 2, "gloo"), chunk_replay.record(b, 0, 2, "gloo")
    ma, mb = sa["engine_metrics"], sb["engine_metrics"]  # the engines did differ: Hybrid Adam's placement, the collectives
    assert ma["optim_chunks_on_device"] > 0 == mb["optim_chunks_on_device"] and sa["comm_per_step"] != sb["comm_per_step"]
    assert ra == rb


@pytest.mark.slow
def test_replay_with_checkpointing_evaluation_and_state_dict_on_four_ranks():
    methods = same_as_full_depth(["+strategy=[hybrid_adam,ckpt]", "model.n_layer=14", "trainer.eval_every=1",
                                  "trainer.save_checkpoint=true", "strategy.chunk.mem_saving_comm=true",
                                  "trainer.grad_accum=2"], 4, ranks=(0, 3))
    assert methods == ["replayed at n_layer=14 from a recorded n_layer=5 step (checked at 6)",
                       "replayed at n_layer=14 from rank 0's recorded n_layer=5 step"], methods


@pytest.mark.slow
def test_replay_under_a_tight_device_budget():
    # a device budget that makes the engine evict chunks and leaves Hybrid Adam one group on the device
    methods = same_as_full_depth(["+strategy=hybrid_adam", "model.n_layer=11", *FAST, "strategy.chunk.device_budget_gb=0.03",
                                  "strategy.chunk.warmup_gpu_chunk_mem_ratio=0.5"], 2, ranks=(0, 1))
    assert all(m.startswith("replayed at n_layer=11") for m in methods), methods


@pytest.mark.slow
def test_plan_equals_the_exact_plan():
    """The whole plan (both planned ranks, fit, traffic, step time) against ``trainer.plan_exact=true``;
    24 blocks is the depth from which the planner samples instead of simulating every block."""
    from memopt.memory.hardware import HardwareConfig
    from memopt.planner.plan import make_plan

    hw = HardwareConfig(name="test", device_memory_gb=1024, host_memory_gb=1024, peak_tflops={"fp32": 1.0},
                        host_device_gbps=1.0, device_device_gbps=1.0, devices_per_node=4, device_is_host=True)
    base = [*COMMON, "+strategy=[hybrid_adam,ckpt]", "model.n_layer=24", *FAST, "trainer.nproc_per_node=4"]
    fast, exact = make_plan(typed(base), hw), make_plan(typed([*base, "trainer.plan_exact=true"]), hw)
    assert all(m.startswith("replayed at n_layer=24") for m in fast["method"].values()), fast["method"]
    assert all(m == "exact" for m in exact["method"].values()), exact["method"]
    for key in ("peak_bytes", "node_host_bytes", "fit", "traffic", "comm_per_step", "flops_per_step", "step_time"):
        assert fast[key] == exact[key], key


@pytest.mark.slow
def test_gpt_10b_on_patrickstars_node_is_replayed():
    """The README's 8-rank gpt_10b chunk plan takes the replay, not the block-by-block simulation."""
    from memopt.planner.extrapolate import simulate

    cfg = typed(["+strategy=[hybrid_adam,ckpt]", "model=gpt_10b", "hardware=v100_patrickstar", "trainer.nproc_per_node=8",
                 "logger=none", "trainer.micro_batch_size=8", "strategy.chunk.mem_saving_comm=true",
                 "strategy.chunk.warmup_gpu_chunk_mem_ratio=0.4", "trainer.save_checkpoint=false"])
    got = simulate(cfg, 0, 8, backend="nccl")
    assert got["method"] == "replayed at n_layer=50 from a recorded n_layer=5 step (checked at 6)", got["method"]

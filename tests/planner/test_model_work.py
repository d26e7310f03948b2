"""The model's own forward and backward (``planner/model_work.py``) as a lower bound of a whole plan: each of its
counts times the accumulation is at most the plan's (FLOPs, attention FLOPs, memory-bound bytes, ops, DTensor ops,
collectives by kind: calls and bus bytes), so its step time is at most the planned step, for every engine whose
wing says so; its FLOPs are the plan's exactly where the engine counts none of its own (all but the chunk engine).
A pipeline's stages together: the sum of its stages' counts is at least the model's, and its plan's step (the
slowest stage's) at least the model's work over pp. The plans are whole (both ranks, two steps, the engine's own
code), as ``+strategy=auto`` ranks them."""
from __future__ import annotations

import pytest

from tests.conftest import typed

COMMON = ["model=gpt_tiny", "model.seq_len=64", "trainer.micro_batch_size=2", "trainer.grad_accum=4",
          "trainer.eval_every=0", "trainer.save_checkpoint=false", "logger=none", "trainer.nproc_per_node=2"]
FAST = [["+strategy=[ckpt,zero2]"], ["+strategy=[tp]", "parallel.tp=2", "strategy.tp.sequence_parallel=true",
                                     "strategy.tp.loss_parallel=true"], ["+strategy=[pipeline]", "parallel.pp=2"],
        ["engine=deepspeed", "+strategy=[ckpt,zero3,cpu_offload]"]]
SLOW = [["engine=deepspeed", "+strategy=[ckpt,zero1]"], ["engine=fsdp2", "+strategy=[bf16,zero3]"],
        ["+strategy=ddp"], ["+strategy=[zero3,cpu_offload]"], ["+strategy=[ddp,cpu_offload]"], ["+strategy=[fp16,zero1]"],
        ["+strategy=[bf16,ckpt,zero2]", "strategy.ckpt.policy=selective"], ["+strategy=[ckpt,zero3]", "strategy.ckpt.policy=every_k"],
        ["+strategy=[tp]", "parallel.tp=2"], ["+strategy=[chunk]"], ["+strategy=[hybrid_adam_bf16,ckpt]"],
        ["+strategy=[act_offload,ckpt,zero2]"], ["model=moe_tiny", "+strategy=[moe,zero2]", "parallel.ep=2"],
        ["model=moe_tiny", "+strategy=[moe,ddp]"], ["engine=deepspeed", "+strategy=[zero2,cpu_offload]"],
        ["engine=deepspeed", "+strategy=[bf16,ddp]"], ["engine=fsdp2", "+strategy=[ckpt,zero2]"],
        ["+strategy=[ckpt,pipeline]", "parallel.pp=2", "strategy.pipeline.schedule=gpipe"],
        ["+strategy=[pipeline]", "parallel.pp=2", "strategy.pipeline.schedule=interleaved_1f1b"],
        ["engine=deepspeed", "+strategy=[bf16,zero3]"], ["model=moe_tiny", "engine=deepspeed", "+strategy=[moe,zero2]", "parallel.ep=2"]]


def every_term():
    """A CPU profile with every term of the step time, so each count weighs in the comparison of the totals."""
    from memopt.memory.hardware import HardwareConfig

    return HardwareConfig(name="terms", device_memory_gb=64.0, host_memory_gb=64.0, devices_per_node=2, device_is_host=True,
                          peak_tflops={"fp32": 0.1, "bf16": 0.05, "fp16": 0.05}, memory_gbps=10.0, op_overhead_us=20.0,
                          dtensor_op_overhead_us=100.0, collective_latency_us=50.0, device_device_gbps=2.0,
                          host_device_gbps=5.0, host_adam_gparams_s=0.5)


def stages_total(cfg) -> dict:
    """A pipeline's counts summed over its stages (the first rank of each, as the plan simulates them)."""
    from memopt.planner.extrapolate import simulate
    from memopt.planner.plan import simulated_ranks

    sims = [simulate(cfg, r, 2) for r in simulated_ranks(2, cfg)]
    assert len(sims) == 2, "both stages simulated"
    traffic, comm = {}, {}
    for sim in sims:
        for k, v in sim["traffic"].items():
            traffic[k] = traffic.get(k, 0) + v
        for kind, rec in sim["comm_per_step"]["ops"].items():
            for k, v in rec.items():
                comm.setdefault(kind, {}).setdefault(k, 0)
                comm[kind][k] += v
    return {"flops_per_step": sum(s["flops"] for s in sims), "traffic": traffic, "comm_per_step": {"ops": comm}}


def shortfalls(counted: dict, step: dict) -> list[str]:
    """The counts where the model's work exceeds ``counted``'s (a plan's, or its stages' sum; none for a lower bound)."""
    bad = [f"flops: model {step['flops']} > plan {counted['flops_per_step']}"] if step["flops"] > counted["flops_per_step"] else []
    for k in ("attention_flops", "op_bytes", "ops", "dtensor_ops"):
        if step["traffic"].get(k, 0) > counted["traffic"].get(k, 0):
            bad.append(f"{k}: model {step['traffic'].get(k, 0)} > plan {counted['traffic'].get(k, 0)}")
    planned = (counted.get("comm_per_step") or {}).get("ops", {})
    for kind, rec in step["comm_per_step"]["ops"].items():
        for k in ("count", "bus_bytes"):
            if rec[k] > planned.get(kind, {}).get(k, 0):
                bad.append(f"{kind} {k}: model {rec[k]} > plan {planned.get(kind, {}).get(k, 0)}")
    return bad


def check(overrides: list[str]) -> None:
    from memopt.planner.engines import wing
    from memopt.planner.model_work import lower_bound_s, model_work, step_of
    from memopt.planner.plan import make_plan

    cfg, hw = typed([*COMMON, *overrides]), every_term()
    assert wing(cfg).model_bound(cfg), "the engine's wing lets its model bound the step"
    plan, work = make_plan(cfg, hw), model_work(cfg)
    pipeline = cfg.parallel.pp > 1
    step = step_of(cfg, work)
    if pipeline:  # the stages' sum against the whole model's work: step_of took a stage's share
        step = {"flops": step["flops"] * 2, "traffic": {k: v * 2 for k, v in step["traffic"].items()},
                "comm_per_step": {"ops": {kind: {k: v * 2 for k, v in rec.items()} for kind, rec in step["comm_per_step"]["ops"].items()}}}
    assert step["traffic"]["ops"] > 300 and step["flops"] > 0  # the model's work was counted
    counted = stages_total(cfg) if pipeline else plan
    bad = shortfalls(counted, step)
    assert not bad, f"{overrides}:\n" + "\n".join(bad)
    if not any(s in ("chunk", "hybrid_adam_bf16") for s in cfg.strategy.selected()):
        assert step["flops"] == counted["flops_per_step"], "the engine counts no FLOPs of its own: all are the model's"
    bound, total = lower_bound_s(cfg, hw, step_of(cfg, work), 2), plan["step_time"]["total_s"]
    assert bound <= total, f"{overrides}: bound {bound} > planned step {total}"
    assert bound > 0.5 * total, f"{overrides}: the model's work is most of the step ({bound} of {total} s)"


@pytest.mark.parametrize("overrides", FAST, ids=[" ".join(o) for o in FAST])
def test_the_models_own_work_bounds_the_plan(overrides):
    check(overrides)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", SLOW, ids=[" ".join(o) for o in SLOW])
def test_the_models_own_work_bounds_the_plan_slow(overrides):
    check(overrides)


def test_a_profile_rating_some_collectives_only_keeps_the_bound():
    """Without a default link rate, a plan with a collective kind its profile does not rate (ZeRO-2's reduce-scatter
    here) leaves its whole communication term out: the bound leaves out the model's (MoE's all-to-all, rated, and
    slow enough here to be most of the step: the control shows the bound over the plan with it)."""
    from dataclasses import replace

    from memopt.planner.model_work import lower_bound_s, model_work, step_of
    from memopt.planner.plan import make_plan, step_time

    cfg = typed([*COMMON, "model=moe_tiny", "+strategy=[moe,zero2]", "parallel.ep=2"])
    hw = replace(every_term(), device_device_gbps=None, collective_gbps_by_kind={"all_to_all": 0.001})
    plan, step = make_plan(cfg, hw), step_of(cfg, model_work(cfg))
    assert plan["step_time"]["comm_s"] is None  # a kind without a rate: the plan's term is out
    assert lower_bound_s(cfg, hw, step, 2) <= plan["step_time"]["total_s"]
    assert step_time(cfg, hw, step, 2)["total_s"] > plan["step_time"]["total_s"]  # with the model's all-to-all in


def test_deepspeeds_own_layers_run_in_the_pass():
    """DeepSpeed's ZeRO-3 linear saves other tensors than ``F.linear`` under autocast (its own Function): the pass
    runs the model through it where DeepSpeed's plan does, cached apart from the model's own code."""
    from memopt.planner.model_work import model_work, work_key

    zero2, zero3 = (typed([*COMMON, "engine=deepspeed", f"+strategy=[bf16,{s}]"]) for s in ("zero2", "zero3"))
    assert work_key(zero2) != work_key(zero3)
    a, b = model_work(zero2), model_work(zero3)
    assert a["flops"] == b["flops"] and a["traffic"]["ops"] != b["traffic"]["ops"]


DRAWN = [["model.n_layer=17", "+strategy=[ckpt,zero3]", "strategy.ckpt.policy=every_k", "strategy.ckpt.k=2"],
         ["model.n_layer=8", "+strategy=[tp]", "parallel.tp=2", "strategy.tp.sequence_parallel=true",
          "strategy.tp.loss_parallel=true"],
         ["model.n_layer=12", "+strategy=[pipeline]", "parallel.pp=2"], ["model.n_layer=8", "engine=deepspeed", "+strategy=[bf16,zero3]"],
         ["model=moe_tiny", "model.n_layer=12", "+strategy=[moe,zero2]", "parallel.ep=2"]]


@pytest.mark.parametrize("overrides", DRAWN, ids=[" ".join(o) for o in DRAWN])
def test_the_pass_drawn_from_two_shallow_depths_counts_what_the_full_depth_does(overrides):
    """Every block (every period: checkpoint segments of k, MoE layers, pipeline stages) adds the same counts, so two
    shallow passes drawn to the model's depth give the full-depth pass's counts exactly: FLOPs, every traffic count,
    every collective kind's calls and bytes."""
    from memopt.planner.model_work import _pass, model_work, pass_depths

    cfg = typed([*COMMON, *overrides])
    depths = pass_depths(cfg)
    assert depths is not None and depths[1] < cfg.model.n_layer, depths  # drawn, not run at full depth
    assert model_work(cfg) == _pass(cfg)

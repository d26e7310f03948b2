"""A lower bound of a candidate's planned step: its model's own forward and backward of one micro-batch.

Why: ``+strategy=auto`` plans whole steps (two of them, on two ranks) of every candidate that could still win,
and the compute bound of ``prune.py`` stops only those a dtype or a recomputation's FLOPs behind. On a CPU
whose fp32 wins, ~30 candidates plan within 15% of each other and each whole plan costs seconds. What they
share is the model's side of a step: every engine whose micro-batch is ``compose.model_on_meta``'s model run
forward and backward under memopt's ``Precision`` (the memopt engine, the chunk engine, FSDP2 and DeepSpeed's rules
through ``engines.base.model_forward`` / ``model_backward``, which this pass runs too; the pipeline's stages each
their share) runs those ops on every micro-batch and adds its own (gradient copies and reductions, gathers,
the optimizer step). So one micro-batch of the model
alone, counted as a plan counts (FLOPs, attention FLOPs, memory-bound bytes, ops, DTensor ops, the collectives
tensor and expert parallelism issue inside the model), times the accumulation, is at most each of those counts
of the candidate's plan, and the step time of that work, a sum of terms each growing with its counts
(``plan.step_time``, same profile), is at most the candidate's planned step: no margin is needed.

A pipeline's stages share each micro-batch's model work (each op runs on one stage; the tied output layer's
copy and the sends are extra), so their mean is at least that work over pp, and a plan's step is its slowest
rank's (``plan.make_plan``), at least the mean of the stages' (the step time is linear in the counts, the bubble
the same for every stage): the bound there is the model's work over pp.

One micro-batch on one rank, no optimizer step, and not at the model's depth: every block (every period of
blocks: checkpoint segments, MoE layers, pipeline stages, ``extrapolate.period``) adds the same counts, so the pass
runs two shallow depths and draws their line to the model's (``pass_depths``; the counts at full depth, exactly:
tests/planner/test_model_work.py). A pass of gpt_small's tensor-parallel model cost 1.5-2.0 s at its 8 blocks,
0.8-1.0 s drawn from 1 and 2; a deep model's (gpt_10b's 50 blocks) is no dearer. Shared by every candidate of the same
model-phase strategies, parallel sizes, precision and micro-batch size (``work_key``). Where an
engine's plan runs the model through layer code of its own (DeepSpeed's ZeRO-3 linear, DeepSpeed-MoE: its wing's
``model_code``), the pass runs inside that code too; an engine whose wing does not say the model bounds it (the
parameter server) is not bounded. Tested against whole plans of every engine and class
(tests/planner/test_model_work.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import torch


def work_key(cfg) -> tuple:
    """What the model's side of a micro-batch depends on: the model and its model-phase strategies (checkpointing,
    tensor parallelism, MoE, ...), the parallel sizes, the precision's dtypes, the micro-batch size and the engine's
    own layer code where its plan runs it (``Wing.model_code``)."""
    from memopt.planner.engines import wing
    from memopt.strategies.base import selected
    from memopt.strategies.precision import Precision

    p = Precision.of(cfg)  # a pipeline's stages run the model of pp=1 (its split is the engine's, not the model's)
    code = wing(cfg).model_code
    return (repr(cfg.model), repr(replace(cfg.parallel, pp=1)), tuple((s.name, repr(o)) for s, o in selected(cfg, "model")),
            p.param_dtype, p.compute_dtype, cfg.trainer.micro_batch_size, (code(cfg) or (None,))[0] if code else None)


def pass_depths(cfg) -> tuple[int, int] | None:
    """The two depths whose passes draw the model's line (``model_work``): a whole ``extrapolate.period`` plus the
    model's depth's remainder of it (the last checkpoint segment, MoE layer or stage as at full depth; a segment of k
    needs k blocks) and one period deeper; None where their blocks are over half the model's (each pass also builds
    the model and runs its embedding and head: a shallow model's own pass is cheaper), or ``trainer.plan_exact=true``."""
    from memopt.planner.extrapolate import period

    if getattr(cfg.trainer, "plan_exact", False):
        return None
    n, p = cfg.model.n_layer, period(cfg)
    first = p + n % p
    return (first, first + p) if 2 * first + p <= n / 2 else None


def model_work(cfg) -> dict:
    """{"flops", "traffic", "comm_per_step"} of one micro-batch's forward and backward of ``cfg``'s composed model
    on rank 0 (a fake world of the run's size), counted as ``simulate_rank`` counts a step: at two shallow depths,
    drawn to the model's (``pass_depths``), or at its own."""
    from memopt.planner.extrapolate import at_depth, lerp_nested

    depths = pass_depths(cfg)
    if depths is None:
        return _pass(cfg)
    a, b = depths
    return lerp_nested(_pass(at_depth(cfg, a)), _pass(at_depth(cfg, b)), a, b, cfg.model.n_layer)


def _pass(cfg) -> dict:
    """``model_work`` at ``cfg``'s own depth."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memopt.compose import materialize_params, model_on_meta
    from memopt.data import TokenBatches, load_tokens
    from memopt.engines.base import model_backward, model_forward
    from memopt.parallel.dims import expected_world
    from memopt.planner.engines import wing
    from memopt.planner.routing import planned_routing
    from memopt.planner.simulate import PlanTracker, fake_world
    from memopt.strategies.precision import Precision

    device, t = torch.device("cpu"), cfg.trainer
    tracker = PlanTracker(device)
    precision = Precision.of(cfg)
    code = wing(cfg).model_code
    own = (code(cfg) if code else None) or (None, contextlib.nullcontext())
    with fake_world(cfg, 0, expected_world(cfg)) as dims, tracker, own[1]:
        data = TokenBatches(load_tokens(cfg.data, cfg.seed), cfg.model.seq_len, cfg.data.val_fraction, cfg.seed)
        with FakeTensorMode(allow_non_fake_inputs=True), planned_routing():
            model = model_on_meta(cfg, device, dims, tracker)
            materialize_params(model, device, precision.param_dtype, storage=True)
            model.train()
            x, y = data.micro_batch(0, 0, dims.dp.rank, dims.dp.size, t.micro_batch_size, t.grad_accum)
            x, y = x.to(device), y.to(device)
            tracker.counting = True
            model_backward(model, model_forward(model, precision, tracker, device, x, y), precision, tracker, t.grad_accum)
            tracker.counting = False
    traffic = dict(tracker.traffic)
    return {"flops": traffic.pop("flops", 0), "traffic": traffic, "comm_per_step": tracker.comm_per_step()}


def step_of(cfg, work: dict) -> dict:
    """``work`` (one micro-batch) times the candidate's accumulation, shaped as a simulated rank for ``plan.step_time``
    (whose total is then a lower bound of the candidate's planned step); under a pipeline, a stage's share of it (the
    pipeline's ranks share each micro-batch's blocks: their mean)."""
    from memopt.parallel.dims import expected_world, resolve_sizes

    k = cfg.trainer.grad_accum / resolve_sizes(cfg.parallel, expected_world(cfg))["pp"]
    times = lambda d: {key: v * k for key, v in d.items()}  # noqa: E731
    return {"flops": work["flops"] * k, "traffic": times(work["traffic"]),
            "comm_per_step": {"ops": {kind: times(rec) for kind, rec in work["comm_per_step"]["ops"].items()}}}


def lower_bound_s(cfg, hw, step: dict, ranks_per_node: int) -> float | None:
    """``plan.step_time``'s total of ``step`` (``step_of``): at most the candidate's planned step. Without a default
    link rate (``device_device_gbps``) a collective kind the profile does not rate leaves a plan's whole
    communication term out (``plan.comm_seconds``), so the bound leaves it out too."""
    from memopt.planner.plan import step_time

    if not hw.device_device_gbps:
        drop = ("comm_bytes", "collectives")
        step = {**step, "traffic": {k: v for k, v in step["traffic"].items() if k not in drop}, "comm_per_step": None}
    return step_time(cfg, hw, step, ranks_per_node)["total_s"]

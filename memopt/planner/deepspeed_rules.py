"""``engine=deepspeed`` planned under DeepSpeed's own rules.

DeepSpeed's engine does not run on fake tensors (its ``module.to(device)`` cannot swap fake
parameters), so its model states come from DeepSpeed's published estimators
(``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``, called from the
installed DeepSpeed: fp16 parameters and gradients, fp32 master and Adam moments, its 1.5 host buffer
factor), and the activations and temporaries from the memopt engine's fake step of the same model
and strategies (DeepSpeed trains the same model code, so what autograd keeps is the same). Stage 0/1
use the stage-2 estimator (DeepSpeed has none for them); the device's model-state bytes are reported
as ``params`` + ``optim`` split the way the estimators' comments split them.
"""
from __future__ import annotations

from dataclasses import replace


def deepspeed_model_states(cfg, world: int, per_node: int) -> dict[str, dict[str, int]]:
    """{"device": {...}, "host": {...}} model-state bytes of one rank under DeepSpeed's estimators."""
    from memopt import compose
    from memopt.strategies.zero import selected_stage

    params = compose.num_params(cfg)
    nodes = max(1, world // per_node)
    offload = cfg.strategy.cpu_offload is not None
    _, stage, _ = selected_stage(cfg)
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        largest = cfg.model.vocab_size * cfg.model.d_model  # the token embedding is the largest module
        host, device, _ = estimate_zero3_model_states_mem_needs(params, largest, per_node, nodes, cpu_offload=offload,
                                                                cpu_offload_params=False, zero_init=True)
        p16 = 4 * largest + (2 * params // world if offload else 2 * params // world)
    else:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        host, device = estimate_zero2_model_states_mem_needs(params, per_node, nodes, cpu_offload=offload)
        p16 = 2 * params
    host_rank = host // per_node  # the estimator's host bytes are per node
    return {"device": {"params": p16, "optim": max(0, device - p16)}, "host": {"optim": host_rank}}


def deepspeed_sim(cfg, rank: int, world: int, limits, backend: str, per_node: int, **depths) -> dict:
    """A simulate_rank-shaped result: activations/temp/other from memopt's fake step, model states from DeepSpeed's rules."""
    from memopt.memory.tracker import CATEGORIES
    from memopt.planner.extrapolate import simulate

    sim = simulate(replace(cfg, engine=replace(cfg.engine, name="memopt")), rank, world, None, backend=backend, **depths)
    states = deepspeed_model_states(cfg, world, per_node)
    peaks = {}
    for mem in ("device", "host"):
        measured = sim["peaks"].get(mem, {})
        cats = {c: 0 for c in CATEGORIES}
        for c in ("activations", "temp", "other"):
            cats[c] = measured.get(c, 0) if mem == "device" else 0
        for c, b in states[mem].items():
            cats[c] += b
        model_states_now = sum(states[mem].values())
        non_model_peak = measured.get("total", 0) - sum(measured.get(c, 0) for c in ("params", "grads", "optim", "chunks"))
        cats["total"] = model_states_now + (max(0, non_model_peak) if mem == "device" else 0)
        peaks[mem] = cats
    sim["peaks"] = peaks
    sim["rules"] = "deepspeed estimators (model states) + memopt fake step (activations, temp)"
    return sim

"""DeepSpeed's wing: its engine does not run on fake tensors, so a rank is planned by DeepSpeed's rules.

    rules.py      model states and buffers from the buffers its ZeRO optimizers allocate, beside memopt's
                  fake step of the same model for activations and temporaries
    params.py     the model's parameters as the translation groups and communicates them (built on meta)
    reductions.py ZeRO-1/2's gradient reductions: buffers, each rank's partition, stage 2's moments, bytes moved
    zero_step.py  the bytes its optimizer step moves (the step time's memory term)
    fetch.py      its ZeRO-3 prefetch and release replayed over the training step
    linear.py     its ZeRO-3 linear Function in the fake step
    moe_rules.py  DeepSpeed-MoE: the expert groups' states, its layer code on fake tensors
    pipe.py       DeepSpeed's pipeline engine (its own entry of the registry): refused with the reason
"""
from __future__ import annotations

import contextlib

from memopt.planner.engines.base import Wing
from memopt.planner.engines.deepspeed.rules import deepspeed_sim


def _model_code(cfg):
    """(name, context) of DeepSpeed's own layer code that its rules' fake step runs the model through: its ZeRO-3
    linear Function (``linear.py``) and DeepSpeed-MoE's layers (``moe_rules.py``); None where neither applies."""
    from memopt.planner.engines.deepspeed.linear import replaces_linear, zero3_linear

    moe, linear = cfg.strategy.moe is not None, replaces_linear(cfg)
    if not (moe or linear):
        return None

    @contextlib.contextmanager
    def inside():
        with contextlib.ExitStack() as stack:
            if moe:
                from memopt.parallel.dims import expected_world, resolve_sizes
                from memopt.planner.engines.deepspeed.moe_rules import deepspeed_moe_layers

                stack.enter_context(deepspeed_moe_layers(resolve_sizes(cfg.parallel, expected_world(cfg))["ep"]))
            stack.enter_context(zero3_linear(cfg))
            yield

    return f"deepspeed{' moe' * moe}{' zero3 linear' * linear}", inside()


WING = Wing(rules=deepspeed_sim, model_bound=lambda cfg: True, model_code=_model_code)

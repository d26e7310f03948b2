"""DeepSpeed's wing: its engine does not run on fake tensors, so a rank is planned by DeepSpeed's rules.

    rules.py      model states and buffers from the buffers its ZeRO optimizers allocate, beside memopt's
                  fake step of the same model for activations and temporaries
    fetch.py      its ZeRO-3 prefetch and release replayed over the training step
    linear.py     its ZeRO-3 linear Function in the fake step
    moe_rules.py  DeepSpeed-MoE: the expert groups' states, its layer code on fake tensors
    pipe.py       DeepSpeed's pipeline engine (its own entry of the registry): refused with the reason
"""
from __future__ import annotations

from memopt.planner.engines.base import Wing
from memopt.planner.engines.deepspeed.rules import deepspeed_sim



def _model_bound(cfg) -> bool:
    """Its rules' fake step is memopt's engine running the same model, except at ZeRO-3 (DeepSpeed's own linear
    Function) and with MoE (DeepSpeed-MoE's layer code): there the model's side is not memopt's."""
    from memopt.strategies.zero import selected_stage

    return selected_stage(cfg)[1] < 3 and cfg.strategy.moe is None


WING = Wing(rules=deepspeed_sim, model_bound=_model_bound)

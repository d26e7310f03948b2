"""The bytes DeepSpeed's optimizer step moves without offload (stage_1_and_2.py's and stage3.py's ``step``, the
engine's ``_take_model_step`` at stage 0), counted by the planner's rule (``simulate.op_work``): the step time's
memory term of a DeepSpeed plan, in place of the fake step's (memopt's translation: its ``step_op_bytes``).
memopt's fused AdamW moves ~44 B a partition element; DeepSpeed's step moves ~104 (gpt_small bf16 zero2, 2 ranks:
1.32 GB a step against 0.56 planned before)."""
from __future__ import annotations

import functools
import math

from memopt.planner.engines.deepspeed.params import group_sizes, param_bytes


@functools.cache
def adamw_bytes_per_element(weight_decay: bool) -> float:
    """Bytes ``torch.optim.AdamW(foreach=True)`` moves per fp32 element of a step after its first, counted by
    the planner's rule on a small tensor: torch's own op sequence, whatever its version (torch 2.13: 56, 52
    without weight decay)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from memopt.planner.simulate import op_work

    class Count(TorchDispatchMode):
        moved = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Count.moved += op_work(func, args, kwargs, out)[1]
            return out

    n = 1 << 12
    with _disable_current_modes(), torch.device("cpu"):
        p = torch.nn.Parameter(torch.zeros(n))
        p.grad = torch.zeros(n)
        opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1 if weight_decay else 0.0, foreach=True)
        opt.step()  # its state made
        with Count():
            opt.step()
    return Count.moved / n


def step_bytes(cfg, W: int) -> int | None:
    """One rank's bytes through DeepSpeed's optimizer step without offload. ZeRO stages 1-3 step each optimizer
    group's share (weight decay on ndim >= 2, then the rest; ``ceil(elements / W)`` a rank), per share element of
    b-byte gradients: the overflow check of 16-bit weights (``amax`` and ``amin``, 2b; stage 3 checks fp16 only); the fp64 norm (``to`` b + 8,
    ``vector_norm`` 8); the share flattened (2b) and cast to fp32 (b + 4 where b != 4); unscaling and clipping in
    place (8, with a clip or fp16's loss scale); ``torch.optim.AdamW``'s step (``adamw_bytes_per_element``); the
    updated fp32 share copied into the b-byte weights (a copy_: 2b + 4). Stage 0 (fp32 weights) steps every
    element the rank holds: its clip (``runtime/utils.clip_grad_norm_``: the norm 4, the scaling 8), AdamW's step
    and, in fp32, the norm memopt's translation computes for the log (``engines/deepspeed._own_grad_norm``: DeepSpeed
    keeps none). None for stage 0 with 16-bit weights (DeepSpeed's own unfused optimizer: the fake step's bytes stay).
    DeepSpeed-MoE's expert groups are each rank's experts shared over the W / ep ranks that hold them
    (``moe_rules.group_sizes``)."""
    from memopt.strategies.zero import selected_stage

    b, o, stage = param_bytes(cfg), cfg.optim, selected_stage(cfg)[1]
    groups = group_sizes(cfg)
    shares = [(False, math.ceil(groups[0] / W)), (True, math.ceil(groups[1] / W))]
    if cfg.strategy.moe is not None:  # DeepSpeed-MoE: the expert groups split over the W / ep ranks holding them
        from memopt.parallel.dims import resolve_sizes
        from memopt.planner.engines.deepspeed import moe_rules

        ep = resolve_sizes(cfg.parallel, W)["ep"]
        dense_no, dense, expert_no, expert = moe_rules.group_sizes(cfg, W)
        shares = [(False, math.ceil(dense_no / W)), (True, math.ceil(dense / W)),
                  (False, math.ceil(expert_no / max(1, W // ep))), (True, math.ceil(expert / max(1, W // ep)))]
    if stage == 0:
        if b != 4:
            return None
        if cfg.strategy.moe is not None:  # the rank's own parameters: dense and its experts, in both groups
            groups = [dense_no + expert_no, dense + expert]
        shares, per = [(False, groups[0]), (True, groups[1])], (12 if o.grad_clip > 0 else 0)
        per += 12 if cfg.strategy.bf16 is None else 0  # the translation's own norm for the log (pow 8, sum 4)
    else:
        # fp16, or at stages 1-2 bf16 weights (``bf16: enabled``): DeepSpeed checks for overflow (stage 3 in fp16
        # only: ``_overflow_check_and_loss_scale_update``); fp16 unscales
        half = cfg.strategy.fp16 is not None or (b == 2 and stage < 3)
        unscale = o.grad_clip > 0 or cfg.strategy.fp16 is not None
        per = (2 * b if half else 0) + (b + 16) + 2 * b + (b + 4 if b != 4 else 0) + (8 if unscale else 0) + 2 * b + 4
    return round(sum(n * (per + adamw_bytes_per_element(decay and o.weight_decay > 0)) for decay, n in shares if n))


def offload_step_bytes(cfg, W: int) -> int | None:
    """One rank's bytes through DeepSpeed's ZeRO-3 step with offload outside the host Adam (the optimizer term's):
    per share element, the fp32 gradient unscaled and clipped in place (8, with a clip or fp16's loss scale) and
    the updated fp32 share copied into the b-byte weights (a copy_: 2b + 4). None for stages 0-2 (the fake step's
    bytes stay: ZeRO-Offload's whole step was 1.00x the plan's)."""
    from memopt.strategies.zero import selected_stage

    if selected_stage(cfg)[1] != 3 or cfg.strategy.moe is not None:
        return None
    b, o = param_bytes(cfg), cfg.optim
    unscale = o.grad_clip > 0 or cfg.strategy.fp16 is not None
    return math.ceil(sum(group_sizes(cfg)) / W) * ((8 if unscale else 0) + 2 * b + 4)

"""The bytes DeepSpeed's ZeRO-1/2 optimizer step moves without offload (stage_1_and_2.py, ``step``), counted by
the planner's rule (``simulate.op_work``): the step time's memory term of a DeepSpeed stage 1/2 plan, in place of
memopt's zero1 step of the fake step (its ``step_op_bytes``). memopt's fused AdamW moves ~44 B a partition element;
DeepSpeed's step moves ~104 (gpt_small bf16 zero2, 2 ranks: 1.32 GB a step against 0.56 planned before)."""
from __future__ import annotations

import functools
import math

from memopt.planner.engines.deepspeed.params import meta_params, param_bytes


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


def step_bytes(cfg, W: int) -> int:
    """One rank's bytes through DeepSpeed's stage 1/2 step without offload, per optimizer group (weight decay on
    ndim >= 2, then the rest; each rank's share of a group, ``ceil(elements / W)``), per share element of b-byte
    gradients: the overflow check of 16-bit weights (``amax`` and ``amin``, 2b); the fp64 norm (``to`` b + 8,
    ``vector_norm`` 8); the share flattened (2b) and cast to fp32 (b + 4 where b != 4); unscaling and clipping in
    place (8, with a clip or fp16's loss scale); ``torch.optim.AdamW``'s step (``adamw_bytes_per_element``); the updated fp32 share
    copied into the b-byte weights (a copy_: 2b + 4)."""
    b, o = param_bytes(cfg), cfg.optim
    groups = [0, 0]
    for n, ndim, _ in meta_params(cfg):
        groups[ndim >= 2] += n
    half = b == 2  # fp16, or bf16 weights (``bf16: enabled``): DeepSpeed checks for overflow; fp16 unscales
    unscale = o.grad_clip > 0 or cfg.strategy.fp16 is not None
    per = (2 * b if half else 0) + (b + 16) + 2 * b + (b + 4 if b != 4 else 0) + (8 if unscale else 0) + 2 * b + 4
    total = 0.0
    for decay, n in ((False, groups[0]), (True, groups[1])):
        if n:
            total += math.ceil(n / W) * (per + adamw_bytes_per_element(decay and o.weight_decay > 0))
    return round(total)

"""DeepSpeed ZeRO-3's own linear in the planner's fake step (``engine=deepspeed`` plans).

Stage 3 converts the model with ``zero.Init``, which (``memory_efficient_linear``, on by default)
replaces ``torch.nn.functional.linear`` with ``LinearFunctionForZeroStage3``: an autograd Function
whose forward runs with autograd off, so it saves its input as given and the weight parameter
itself. ``F.linear`` under autocast instead saves the bf16 copies autocast makes of both: on gpt_tiny
with bf16 autocast that is 1.34 MB more activations than DeepSpeed keeps (4,245,000 B against
2,901,512 B measured in its first forward). The fake step runs DeepSpeed's Function, so what it
keeps is what DeepSpeed keeps.
"""
from __future__ import annotations

import contextlib


class _PlannerAccelerator:
    """The planner's compute device (cpu, placement is logical), where the fake step autocasts:
    the Function reads its autocast state for that device type."""

    @staticmethod
    def device_name(*_):
        return "cpu"


def replaces_linear(cfg) -> bool:
    """Whether the translated DeepSpeed config has stage 3 with ``memory_efficient_linear``."""
    zero = dict((cfg.engine.deepspeed or {}).get("zero_optimization", {}) or {})
    from memopt.strategies.zero import selected_stage

    return selected_stage(cfg)[1] == 3 and bool(zero.get("memory_efficient_linear", True))


@contextlib.contextmanager
def zero3_linear(cfg):
    """``F.linear`` is DeepSpeed's stage-3 Function inside the block when the run's would be."""
    if not replaces_linear(cfg):
        yield
        return
    import torch.nn.functional as F
    from deepspeed.runtime.zero import linear

    saved = F.linear, linear.get_accelerator
    F.linear, linear.get_accelerator = linear.zero3_linear_wrap, _PlannerAccelerator
    try:
        yield
    finally:
        F.linear, linear.get_accelerator = saved

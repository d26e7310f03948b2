"""The one function that applies the selected strategies to the model and the optimizer.

The order is fixed and readable here (torchtitan style):
    model on meta -> attention implementation -> activation checkpointing (+ activation offload)
    -> precision (parameter dtype, autocast, loss scaler) -> materialise and initialise from the
    seed -> optimizer (fp32 master weights when parameters are low precision)
Later stages (partitioners, offload, the chunk engine) plug in between precision and the optimizer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from memopt.config import TrainConfig
from memopt.memory.tracker import MemoryTracker
from memopt.models.gpt import GPT
from memopt.optim import MixedPrecisionAdamW
from memopt.strategies.checkpointing import apply_checkpointing
from memopt.strategies.flash_attention import apply_flash_attention
from memopt.strategies.precision import Precision


@dataclass
class Built:
    model: GPT
    optimizer: MixedPrecisionAdamW
    precision: Precision
    device: torch.device


def materialize(model: GPT, device: torch.device, dtype: torch.dtype, seed: int, tracker: MemoryTracker | None = None) -> GPT:
    """Allocate a meta-device model on ``device`` in ``dtype`` and fill it from the seed."""
    memo: dict[int, torch.nn.Parameter] = {}
    with tracker.category("params") if tracker is not None else _nullctx():
        for mod in model.modules():  # one allocation per distinct parameter: ties are kept
            for name, p in mod._parameters.items():
                if p is not None:
                    if id(p) not in memo:
                        memo[id(p)] = torch.nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype), requires_grad=p.requires_grad)
                    mod._parameters[name] = memo[id(p)]
    with tracker.category("temp") if tracker is not None else _nullctx():
        model.init_weights(seed)  # float32 values drawn on the CPU, cast on copy
    return model


def build(cfg: TrainConfig, device: torch.device, tracker: MemoryTracker | None = None) -> Built:
    s = cfg.strategy
    with torch.device("meta"):
        model = GPT(cfg.model)
    if s.flash_attn is not None:
        apply_flash_attention(model, device)
    if s.ckpt is not None:
        apply_checkpointing(model, s.ckpt, s.act_offload, tracker)
    precision = Precision.from_strategies(s.fp16, s.bf16)
    materialize(model, device, precision.param_dtype, cfg.seed, tracker)
    if tracker is not None:
        tracker.register_module(model)
    optimizer = MixedPrecisionAdamW(model, cfg.optim, precision, tracker)
    return Built(model, optimizer, precision, device)


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

"""``+strategy=flash_attn``: the model's attention core runs memopt's Triton FlashAttention.

Only O and the log-sum-exp are kept for the backward pass, so the attention activations of a
layer grow linearly with the sequence length instead of quadratically. On a machine without CUDA
the kernel runs only under Triton's interpreter (``TRITON_INTERPRET=1``, slow: for tests); without
it, selecting the strategy is an error. It never falls back to SDPA silently.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from memopt.errors import ConfigError

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


@dataclass
class FlashAttnConfig:
    """No knobs: block sizes are autotuned on CUDA and fixed under the interpreter."""


def validate(model_cfg) -> None:
    if model_cfg.head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"strategy flash_attn supports head dims {SUPPORTED_HEAD_DIMS}; model.d_model/model.n_head = "
            f"{model_cfg.d_model}/{model_cfg.n_head} = {model_cfg.head_dim}"
        )
    if model_cfg.dropout > 0:
        raise ValueError(f"strategy flash_attn has no attention dropout; set model.dropout=0 (it is {model_cfg.dropout})")


def apply_flash_attention(model, device: torch.device) -> None:
    """Point every block's attention core at the kernel, after checking it can run on ``device``."""
    from memopt.kernels.flash_attn import flash_attn_available

    ok, why = flash_attn_available(device)
    if not ok:
        raise ConfigError(f"strategy flash_attn cannot run on {device}: {why}")
    for block in model.blocks:
        block.attn.core.impl = "flash"

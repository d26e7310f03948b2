"""``+strategy=flash_attn``: every block's attention core runs memopt's Triton FlashAttention.

Only O and the log-sum-exp are kept for the backward pass, so the attention activations of a
layer grow linearly with the sequence length instead of quadratically. On a machine without CUDA
the kernel runs only under Triton's interpreter (``TRITON_INTERPRET=1``, slow: for tests); without
it, selecting the strategy is an error. It never falls back to SDPA silently.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from memopt.errors import ConfigError
from memopt.strategies.base import Build, Strategy, register

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


@dataclass
class FlashAttnConfig:
    """No knobs: block sizes are autotuned on CUDA and fixed under the interpreter."""


class FlashCore(torch.nn.Module):
    """The ``attention_core`` slot: causal softmax(q k^T / sqrt(D)) v by the Triton kernel; (B, H, T, D) in and out.

    Grouped-query attention (model.arch=llama: k and v with K < H heads): k and v are repeated to H
    heads before the kernel, which has no head grouping of its own. The repeated copies are what the
    kernel keeps for its backward (2 (H - K) D values per token more than a grouped kernel would)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from memopt.kernels.flash_attn import flash_attn

        if k.size(1) != q.size(1):  # (B, K, T, D) -> (B, H, T, D): kv head j serves query heads j*H/K ...
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
            v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
        return flash_attn(q, k, v, causal=True)


@register
class FlashAttn(Strategy):
    name, Config, phase, order = "flash_attn", FlashAttnConfig, "model", 10

    def validate(self, opts, cfg) -> None:
        m = cfg.model
        if m.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ConfigError(
                f"strategy flash_attn supports head dims {SUPPORTED_HEAD_DIMS}; model.d_model/model.n_head = "
                f"{m.d_model}/{m.n_head} = {m.head_dim}")
        if m.dropout > 0:
            raise ConfigError(f"strategy flash_attn has no attention dropout; set model.dropout=0 (it is {m.dropout})")

    def apply(self, model, opts, build: Build) -> None:
        """Put the kernel in every block's attention core, after checking it can run on the device."""
        from memopt.kernels.flash_attn import flash_attn_available

        ok, why = flash_attn_available(build.device)
        if not ok:
            raise ConfigError(f"strategy flash_attn cannot run on {build.device}: {why}")
        for i in range(len(model.blocks)):
            model.set_slot(i, "attention_core", FlashCore())

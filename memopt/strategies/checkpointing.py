"""Activation checkpointing (Chen et al. 2016; Korthikanti et al. 2022) and activation offload.

Policies:
- ``full``: every block is a checkpoint; only block inputs (the L boundary tensors) stay alive
  after the forward, and one block is recomputed at a time in the backward.
- ``every_k``: consecutive blocks form segments of k; each segment is one checkpoint, so
  L/k boundary tensors plus one segment's activations are alive (k = sqrt(L) is Chen et al.'s
  sublinear choice, the default when ``k`` is unset).
- ``selective``: only the attention core (scores, softmax, dropout) is recomputed; everything
  else is kept.

All of them use PyTorch's non-reentrant checkpoint with the RNG state preserved, so dropout masks
are identical in the recomputation and the loss is bit-for-bit that of the plain run.

``act_offload`` keeps each checkpoint's input on the host instead of the compute device and brings
it back just before the recomputation (PatrickStar's activation offload). It needs ``ckpt``.
On CUDA the host copy is pinned and asynchronous; on a CPU-only machine it is a copy accounted as
host memory so that the move is visible in the run records.
"""
from __future__ import annotations

import math
import types
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from memopt.memory.tracker import MemoryTracker

POLICIES = ("full", "every_k", "selective")


@dataclass
class CkptConfig:
    """``+strategy=ckpt``: which activations are recomputed in the backward pass."""

    policy: str = "full"  # full | every_k | selective
    k: int | None = None  # segment length for every_k; None means round(sqrt(n_layer))


@dataclass
class ActOffloadConfig:
    """``+strategy=act_offload``: checkpoint inputs live in host memory between forward and backward."""

    pin_memory: bool = True  # pinned host buffers (CUDA only) so copies run asynchronously


def resolve_k(cfg: CkptConfig, n_layer: int) -> int:
    k = cfg.k if cfg.k is not None else max(1, round(math.sqrt(n_layer)))
    if not 1 <= k <= n_layer:
        raise ValueError(f"strategy.ckpt.k={cfg.k} is out of range: it must be between 1 and model.n_layer={n_layer}")
    return k


def validate(cfg: CkptConfig, n_layer: int) -> None:
    if cfg.policy not in POLICIES:
        raise ValueError(f"strategy.ckpt.policy={cfg.policy!r} is not a checkpointing policy; use one of: {', '.join(POLICIES)}")
    if cfg.policy == "every_k":
        resolve_k(cfg, n_layer)
    elif cfg.k is not None:
        raise ValueError(f"strategy.ckpt.k={cfg.k} only applies to strategy.ckpt.policy=every_k (policy is {cfg.policy!r})")


class _Boundary:
    """Holds a checkpoint's input, on the compute device or on the host."""

    def __init__(self, x: torch.Tensor):
        self.x = x
        self.device = x.device

    def offload(self, pin: bool, tracker: MemoryTracker | None) -> None:
        x = self.x.detach()
        if x.device.type == "cuda":
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=pin)
            host.copy_(x, non_blocking=True)
        else:
            with tracker.host_scope() if tracker is not None else _null():
                host = x.clone()
        self.x = host

    def fetch(self) -> torch.Tensor:
        return self.x.to(self.device, non_blocking=True)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _segment_forward(blocks, holder: _Boundary, rope, tracker: MemoryTracker | None):
    """Run blocks on the held input; under a recomputation the tracker counts it as activations."""
    x = holder.fetch() if holder.x.device != holder.device else holder.x
    ctx = tracker.retained("activations") if tracker is not None else _null()
    with ctx:
        for b in blocks:
            x = b(x, rope)  # through the module call, so partitioner hooks (zero3 gathers) run
    return x


def apply_checkpointing(model, cfg: CkptConfig, offload: ActOffloadConfig | None = None, tracker: MemoryTracker | None = None) -> None:
    """Install the policy on ``model`` (a memopt GPT) in place; parameter names do not change."""
    L = len(model.blocks)
    validate(cfg, L)
    if cfg.policy == "selective":
        if offload is not None:
            raise ValueError("strategy act_offload needs strategy.ckpt.policy=full or every_k: selective keeps block inputs on the device")
        for block in model.blocks:
            core = block.attn.core
            plain = core.forward

            def run_core(q, k, v, _f=plain):
                with tracker.retained("activations") if tracker is not None else _null():
                    return _f(q, k, v)

            core.forward = types.MethodType(
                lambda self, q, k, v, _f=run_core: checkpoint(_f, q, k, v, use_reentrant=False, preserve_rng_state=True), core
            )
        return
    k = 1 if cfg.policy == "full" else resolve_k(cfg, L)
    segments = [list(model.blocks[i : i + k]) for i in range(0, L, k)]

    def run_blocks(self, x, rope):
        for seg in segments:
            holder = _Boundary(x)
            x = checkpoint(_segment_forward, seg, holder, rope, tracker, use_reentrant=False, preserve_rng_state=True)
            if offload is not None:
                holder.offload(offload.pin_memory, tracker)
        return x

    model.run_blocks = types.MethodType(run_blocks, model)

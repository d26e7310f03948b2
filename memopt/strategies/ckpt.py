"""``+strategy=ckpt``: activation checkpointing (Chen et al. 2016; Korthikanti et al. 2022).

Policies:
- ``full``: every block is a checkpoint; only block inputs (the L boundary tensors) stay alive
  after the forward, and one block is recomputed at a time in the backward.
- ``every_k``: consecutive blocks form segments of k; each segment is one checkpoint, so
  L/k boundary tensors plus one segment's activations are alive (k = sqrt(L) is Chen et al.'s
  sublinear choice, the default when ``k`` is unset).
- ``selective``: only the attention core (scores, softmax, dropout) is recomputed; everything
  else is kept.

All of them use PyTorch's non-reentrant checkpoint with the RNG state preserved, so dropout masks
are identical in the recomputation and the loss is bit-for-bit that of the plain run. ``full`` and
``every_k`` replace the model's ``block_runner`` slot by a ``SegmentRunner``; ``selective`` wraps
each block's ``attention_core`` slot. ``act_offload`` (its own module) moves the runner's segment
inputs to the host.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from memopt.errors import ConfigError
from memopt.strategies.base import Build, Strategy, register

POLICIES = ("full", "every_k", "selective")


@dataclass
class CkptConfig:
    """``+strategy=ckpt``: which activations are recomputed in the backward pass."""

    policy: str = "full"  # full | every_k | selective
    k: int | None = None  # segment length for every_k; None means round(sqrt(n_layer))


def resolve_k(cfg: CkptConfig, n_layer: int) -> int:
    k = cfg.k if cfg.k is not None else max(1, round(math.sqrt(n_layer)))
    if not 1 <= k <= n_layer:
        raise ConfigError(f"strategy.ckpt.k={cfg.k} is out of range: it must be between 1 and model.n_layer={n_layer}")
    return k


class Boundary:
    """A checkpoint's input: on the compute device, or moved to the host by ``act_offload``."""

    def __init__(self, x: torch.Tensor):
        self.x = x
        self.device = x.device
        self.requires_grad = x.requires_grad

    def fetch(self) -> torch.Tensor:
        """The input on its device. An offloaded copy (detached) is marked as requiring grad like the
        original, as the checkpoint does with the tensors it is handed: the recomputation must save
        the same tensors as the forward (an RMSNorm saves its input only when it requires grad)."""
        x = self.x.to(self.device, non_blocking=True) if self.x.device != self.device else self.x
        if self.requires_grad and not x.requires_grad:
            x = x.detach().requires_grad_(True)
        return x


def _segment_forward(blocks, holder: Boundary, tracker, *extra):
    """Run blocks on the held input; under a recomputation the tracker counts it as activations."""
    x = holder.fetch()
    with tracker.retained("activations"):
        for b in blocks:
            x = b(x, *extra)  # through the module call, so partitioner hooks (zero3 gathers) run
    return x


class SegmentRunner:
    """``block_runner`` for ``full`` / ``every_k``: one checkpoint per segment of ``k`` blocks.
    ``offload`` (set by act_offload) is called with each segment's ``Boundary`` after its forward."""

    def __init__(self, k: int, tracker):
        self.k, self.tracker, self.offload = k, tracker, None

    def __call__(self, blocks, x: torch.Tensor, *extra) -> torch.Tensor:
        for i in range(0, len(blocks), self.k):
            holder = Boundary(x)
            x = checkpoint(_segment_forward, list(blocks[i : i + self.k]), holder, self.tracker, *extra,
                           use_reentrant=False, preserve_rng_state=True)
            if self.offload is not None:
                self.offload(holder)
        return x


class CheckpointedCore(torch.nn.Module):
    """``selective``: an attention core (no parameters) whose forward is recomputed in the backward."""

    def __init__(self, inner: torch.nn.Module, tracker):
        super().__init__()
        self.inner, self.tracker = inner, tracker

    def _run(self, q, k, v):
        with self.tracker.retained("activations"):
            return self.inner(q, k, v)

    def forward(self, q, k, v):
        return checkpoint(self._run, q, k, v, use_reentrant=False, preserve_rng_state=True)


@register
class Ckpt(Strategy):
    name, Config, phase, order = "ckpt", CkptConfig, "model", 20

    def validate(self, c: CkptConfig, cfg) -> None:
        if c.policy not in POLICIES:
            raise ConfigError(f"strategy.ckpt.policy={c.policy!r} is not a checkpointing policy; use one of: {', '.join(POLICIES)}")
        if c.policy == "every_k":
            resolve_k(c, cfg.model.n_layer)
        elif c.k is not None:
            raise ConfigError(f"strategy.ckpt.k={c.k} only applies to strategy.ckpt.policy=every_k (policy is {c.policy!r})")

    def apply(self, model, c: CkptConfig, build: Build) -> None:
        if c.policy == "selective":
            for i in range(len(model.blocks)):
                model.set_slot(i, "attention_core", CheckpointedCore(model.slot(i, "attention_core"), build.tracker))
            return
        k = 1 if c.policy == "full" else resolve_k(c, len(model.blocks))
        model.block_runner = SegmentRunner(k, build.tracker)

"""The decisions every optimizer step makes, in one order, for every engine that owns its step
(memopt's ``ShardedAdamW``, the chunk engine's ``ChunkAdam``, the FSDP2 engine):

1. overflow vote (fp16): a non-finite gradient on any rank skips the step on every rank; the loss
   scaler backs off or grows (``Precision.scaler``)
2. unscale: gradients are multiplied by ``inv`` = 1 / (loss scale x ranks whose gradients were summed)
3. global gradient norm: the squared norms of the gradients each rank owns, summed over the
   partition dimension when gradients are sharded, and the clip coefficient ``clip / (norm + 1e-6)``
   when the norm exceeds ``optim.grad_clip``

With tensor parallelism (``tp``: the mesh's tp dimension) the split gradients differ between tp ranks:
they vote on overflow too, and the other tp ranks' squared norms of their split gradients are added
(replicated gradients, identical on every tp rank, count once). With pipeline parallelism (``pp``) every
stage holds different parameters: the stages vote on overflow and their squared norms are summed (the
engine leaves out of its share what another stage counts already: a tied output layer).

The engine supplies the local pieces (which gradients it owns, in which dtype and where); the
collectives and decisions are here, so the three engines cannot drift apart.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class StepResult:
    skipped: bool
    grad_norm: float
    loss_scale: float


class StepSequence:
    """One step's overflow vote, unscale factor and clip coefficient (see the module docstring).

    ``dim``: the dimension whose ranks own the gradients (its collectives); ``summed_over``: how many
    ranks' gradients were summed into each one (1 where the reduction already averaged);
    ``device``: where the collectives' tensors live (NCCL reduces device tensors only); ``tp``: the
    tensor-parallel dimension when some gradients are split over it; ``pp``: the pipeline dimension
    whose stages hold the other parameters.
    """

    def __init__(self, precision, grad_clip: float, dim, summed_over: int = 1, device: torch.device | str = "cpu",
                 tp=None, pp=None):
        self.precision, self.grad_clip, self.dim, self.device = precision, grad_clip, dim, device
        self.tp = tp if tp is not None and tp.enabled else None
        self.pp = pp if pp is not None and pp.enabled else None
        self.scale = precision.loss_scale
        self.inv = 1.0 / (self.scale * summed_over)

    def skip(self, local_overflow) -> bool:
        """The overflow vote (a bool, or a 0-dim tensor > 0 on overflow): True when the step must be
        skipped. Updates the loss scaler; without one (fp32 / bf16) no step is ever skipped."""
        if self.precision.scaler is None:
            return False
        flag = local_overflow if isinstance(local_overflow, torch.Tensor) else \
            torch.tensor(float(local_overflow), dtype=torch.float32, device=self.device)
        if self.tp is not None:
            self.tp.all_reduce_(flag, op=dist.ReduceOp.MAX)
        self.dim.all_reduce_(flag, op=dist.ReduceOp.MAX)
        if self.pp is not None:
            self.pp.all_reduce_(flag, op=dist.ReduceOp.MAX)
        overflow = bool(flag.item())
        self.precision.scaler.update(overflow)
        return overflow

    def clip(self, local_sq: torch.Tensor, sharded: bool, split_sq: torch.Tensor | None = None) -> tuple[float, float | None]:
        """(global norm, clip coefficient or None) from this rank's squared norm of its unscaled gradients;
        ``split_sq``: the part of it from tp-split gradients (the other tp ranks' parts are added)."""
        if self.tp is not None and split_sq is not None:
            local_sq = tp_squared_norm(local_sq, split_sq, self.tp)
        if sharded and self.dim.enabled:
            local_sq = local_sq.to(self.device, torch.float32)
            self.dim.all_reduce_(local_sq)
        if self.pp is not None:  # every stage's parameters: the sum of the stages' squared norms
            local_sq = local_sq.to(self.device, torch.float32)
            self.pp.all_reduce_(local_sq)
        norm = math.sqrt(local_sq.item())
        clip = self.grad_clip
        return norm, (clip / (norm + 1e-6) if clip > 0 and norm > clip else None)

    def skipped(self) -> StepResult:
        return StepResult(True, float("nan"), self.scale)

    def done(self, norm: float) -> StepResult:
        return StepResult(False, norm, self.scale)


def tp_squared_norm(sq: torch.Tensor, mine: torch.Tensor, tp) -> torch.Tensor:
    """The squared gradient norm of a tensor-parallel model, the same value on every tp rank.

    ``sq``: this rank's sum over every gradient it holds; ``mine``: the part of it from parameters
    split over tp (replicated ones are identical on every tp rank and count once). One all-reduce of
    (mine, sq - mine) gives the split parts of every rank and tp copies of the replicated part, so
    every rank computes the same number from the same two sums. (``sq + all_reduce(mine) - mine``
    rounds differently on each rank: the clip coefficients then differed in the last bit, the
    replicated parameters drifted apart between tp ranks, and a checkpoint, which stores one copy of
    a replicated tensor, resumed the other rank off by that much.)"""
    both = torch.stack([mine, sq - mine])
    tp.all_reduce_(both)
    return both[0] + both[1] / tp.size

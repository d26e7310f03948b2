"""``+strategy=act_offload``: checkpoint inputs live in host memory between forward and backward
(PatrickStar's activation offload). It needs ``ckpt`` with policy ``full`` or ``every_k``: each
segment's input is copied to the host after the segment's forward and brought back just before its
recomputation. On CUDA the host copy is pinned and asynchronous; on a CPU-only machine it is a copy
accounted as host memory, so the move is visible in the run records.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from memopt.errors import ConfigError
from memopt.strategies.base import Build, Strategy, register
from memopt.strategies.ckpt import Boundary, SegmentRunner


@dataclass
class ActOffloadConfig:
    """``+strategy=act_offload``: checkpoint inputs live in host memory between forward and backward."""

    pin_memory: bool = True  # pinned host buffers (CUDA only) so copies run asynchronously


class HostOffload:
    """Moves a segment's ``Boundary`` to the host (``SegmentRunner.offload``)."""

    def __init__(self, pin: bool, tracker):
        self.pin, self.tracker = pin, tracker

    def __call__(self, holder: Boundary) -> None:
        x = holder.x.detach()
        if x.device.type == "cuda":
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=self.pin)
            host.copy_(x, non_blocking=True)
        else:
            with self.tracker.host_scope():
                host = x.clone()
        holder.x = host


@register
class ActOffload(Strategy):
    name, Config, phase, order = "act_offload", ActOffloadConfig, "model", 30
    requires, requires_why = ("ckpt",), "it offloads the checkpointed activations"

    def validate(self, a: ActOffloadConfig, cfg) -> None:
        if cfg.strategy.ckpt is not None and cfg.strategy.ckpt.policy == "selective":
            raise ConfigError(
                "strategy act_offload needs strategy.ckpt.policy=full or every_k "
                "(selective recomputes only the attention core and keeps block inputs on the device)")

    def apply(self, model, a: ActOffloadConfig, build: Build) -> None:
        runner = model.block_runner
        if not isinstance(runner, SegmentRunner):
            raise ConfigError("strategy act_offload needs strategy ckpt (policy full or every_k) applied before it")
        runner.offload = HostOffload(a.pin_memory, build.tracker)

"""``+strategy=cpu_offload`` (ZeRO-Offload, Ren et al. 2021): fp32 master weights and Adam states on
the host, gradients streamed to the host, the Adam step on the host (``memopt.optim.cpu_adam``),
updated parameters sent back. Alone it offloads a single rank's optimizer; with zero1/2/3 each rank
offloads its shard. Implemented by the optimizer of ``engine=memopt`` and translated by the baselines.
"""
from __future__ import annotations

from dataclasses import dataclass

from memopt.strategies.base import Strategy, register


@dataclass
class CpuOffloadConfig:
    """``+strategy=cpu_offload``: optimizer states and step on the host."""

    pin_memory: bool = True  # pinned host buffers on CUDA for asynchronous copies


@register
class CpuOffload(Strategy):
    name, Config, phase = "cpu_offload", CpuOffloadConfig, "offload"

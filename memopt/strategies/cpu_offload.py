"""``+strategy=cpu_offload`` (ZeRO-Offload, Ren et al. 2021): fp32 master weights and Adam states on
the host, gradients streamed to the host, the Adam step on the host (``memopt.optim.cpu_adam``),
updated parameters sent back. Alone it offloads a single rank's optimizer; with zero1/2/3 each rank
offloads its shard. Implemented by the optimizer of ``engine=memopt`` and translated by the baselines.

With zero3, ``offload_param`` (default on, as the DeepSpeed translation always did) also keeps each
rank's parameter shard on the host: a block's all-gather reads it from there, the host step writes
the updated low-precision shard there, and the device holds only the gathered blocks. Without zero3
parameters are not sharded and stay on the device (the option only applies to zero3).
"""
from __future__ import annotations

from dataclasses import dataclass

from memopt.errors import ConfigError
from memopt.strategies.base import Strategy, register
from memopt.strategies.zero import selected_stage


@dataclass
class CpuOffloadConfig:
    """``+strategy=cpu_offload``: optimizer states and step on the host."""

    pin_memory: bool = True  # pinned host buffers on CUDA for asynchronous copies
    offload_param: bool = True  # with zero3: the parameter shards live on the host too (DeepSpeed's offload_param)


@register
class CpuOffload(Strategy):
    name, Config, phase = "cpu_offload", CpuOffloadConfig, "offload"

    def validate(self, opts, cfg) -> None:
        from memopt.engines import engine_module

        if not opts.offload_param and getattr(engine_module(cfg), "OFFLOADS_PARAMS_ALWAYS", False):
            raise ConfigError(f"strategy.cpu_offload.offload_param=false is not translated for engine={cfg.engine.name}: "
                              "it always offloads the parameter shards with the optimizer (FSDP2's CPUOffloadPolicy); "
                              "use engine=memopt or engine=deepspeed")


def offloads_params(cfg) -> bool:
    """Parameter shards on the host: cpu_offload with offload_param under zero3."""
    off = cfg.strategy.cpu_offload
    return off is not None and off.offload_param and selected_stage(cfg)[1] == 3

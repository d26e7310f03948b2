"""Data parallelism and ZeRO stages 1-3 (Rajbhandari et al. 2020): ``+strategy=ddp|zero1|zero2|zero3``.

What each stage keeps per data-parallel rank (n parameters, W = ``parallel`` dp_shard size, fp32 Adam):

    ddp    params n, grads n, optimizer states for all n
    zero1  params n, grads n, optimizer states (and fp32 master) for n/W
    zero2  params n, grads n/W (+ one bucket in flight), optimizer states n/W
    zero3  params n/W (+ the blocks gathered for compute), grads n/W, optimizer states n/W

The options live here; the flat groups and hooks that implement them for ``engine=memopt`` are in
``memopt/engines/memopt/``, and the DeepSpeed / FSDP2 engines translate them. No stage selected
is ddp (with W = 1 for one process): the plain run.
"""
from __future__ import annotations

from dataclasses import dataclass

from memopt.errors import ConfigError
from memopt.strategies.base import Strategy, register


@dataclass
class DdpConfig:
    """``+strategy=ddp``: replicate everything, all-reduce gradients (the reference for ZeRO)."""

    bucket_mb: float = 25.0  # gradient bucket size (MiB of parameters per all-reduce)
    overlap_comm: bool = True  # launch each bucket's all-reduce asynchronously in backward


@dataclass
class Zero1Config:
    """``+strategy=zero1``: partition optimizer states (and fp32 master weights) across ranks."""

    bucket_mb: float = 25.0
    overlap_comm: bool = True  # launch each bucket's reduce-scatter asynchronously in the last backward


@dataclass
class Zero2Config:
    """``+strategy=zero2``: also reduce-scatter gradients into owned shards during backward."""

    bucket_mb: float = 25.0  # DeepSpeed reduce_bucket_size analogue
    overlap_comm: bool = True  # launch each bucket's reduce-scatter asynchronously in backward


@dataclass
class Zero3Config:
    """``+strategy=zero3``: also partition parameters; gather one block at a time."""

    prefetch: bool = True  # gather the next block while the current one computes
    overlap_comm: bool = True


STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
DEFAULT = DdpConfig()  # the options of the plain run (ddp with one rank)


def selected_stage(cfg) -> tuple[str, int, object]:
    """(name, stage, options) of the selected data-parallel stage; ddp with defaults when none is."""
    for name, stage in STAGES.items():
        opts = getattr(cfg.strategy, name, None)
        if opts is not None:
            return name, stage, opts
    return "ddp", 0, DEFAULT


class _Stage(Strategy):
    phase, group = "partition", "partition"
    group_why = "each is a data-parallel / ZeRO stage; select one"

    def validate(self, opts, cfg) -> None:
        bucket = getattr(opts, "bucket_mb", None)
        if bucket is not None and bucket <= 0:
            raise ConfigError(f"strategy.{self.name}.bucket_mb={bucket} must be > 0")


@register
class Ddp(_Stage):
    name, Config, order = "ddp", DdpConfig, 0


@register
class Zero1(_Stage):
    name, Config, order = "zero1", Zero1Config, 1


@register
class Zero2(_Stage):
    name, Config, order = "zero2", Zero2Config, 2


@register
class Zero3(_Stage):
    name, Config, order = "zero3", Zero3Config, 3

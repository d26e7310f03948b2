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
    grad_dtype: str = "fp32"  # the owned gradient shard: fp32 (accumulated in fp32) | param (the parameters' dtype)


@dataclass
class Zero3Config:
    """``+strategy=zero3``: also partition parameters; gather one block at a time."""

    prefetch: bool = True  # gather the next block while the current one computes
    overlap_comm: bool = True
    grad_dtype: str = "fp32"  # as zero2's


# ``grad_dtype`` (zero2/zero3): the dtype of each rank's owned gradient shard, which lives from the
# first backward to the step. The reduce-scatter runs in the parameters' dtype either way, so with
# one micro-batch per step both choices give the same values; they differ in where micro-batches are
# summed. ``fp32`` (the default, DeepSpeed's bf16 behaviour) adds each micro-batch's reduced shard into
# an fp32 shard: 4 B per parameter / W. ``param`` keeps the shard in the parameters' dtype, the ZeRO
# paper's count (2 B per parameter / W for fp16/bf16 weights), and adds micro-batches in that dtype:
# with bf16 (8 significant bits) a sum of k micro-batches loses up to ~log2(k) bits more, fp16 keeps
# 11 bits but its overflow check then also covers the accumulated sum. fp32 parameters: no difference.
GRAD_DTYPES = ("fp32", "param")


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
        gd = getattr(opts, "grad_dtype", "fp32")
        if gd not in GRAD_DTYPES:
            raise ConfigError(f"strategy.{self.name}.grad_dtype={gd!r} is not one of: {', '.join(GRAD_DTYPES)} "
                              "(fp32: owned gradient shard in fp32; param: in the parameters' dtype)")
        if gd != "fp32" and cfg.engine.name != "memopt":
            raise ConfigError(f"strategy.{self.name}.grad_dtype={gd!r} is built for engine=memopt only (engine="
                              f"{cfg.engine.name} keeps fp32 gradient shards; its own option is not translated); "
                              f"use strategy.{self.name}.grad_dtype=fp32 or engine=memopt")


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

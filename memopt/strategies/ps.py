"""``+strategy=ps``: data parallelism through a parameter server (Li et al. 2014), synchronous.

Rank 0 is the server: it holds the only optimizer (fp32 Adam moments; the weights are updated in
place) and every rank, the server included, runs forward and backward on its own micro-batches.
At each step the workers push their flat gradients to the server (point-to-point sends), the server
sums them with its own, takes the AdamW step over the average, and the workers pull the fresh
weights back (sends from the server). The arithmetic is ddp's (sum of the ranks' gradients, times
1/W in the step), so the fp32 trajectory is ddp's; the difference is the traffic: the server's link
carries (W-1) x the gradient bytes in and (W-1) x the weight bytes out per step, where a ring
all-reduce moves 2 (W-1)/W x the gradient bytes per rank (``experiments/ps/``).

Implemented by ``memopt/engines/ps.py`` (``engine = "ps"``); only the synchronous form is built.
"""
from __future__ import annotations

from dataclasses import dataclass

from memopt.errors import ConfigError
from memopt.strategies.base import Strategy, register


@dataclass
class PsConfig:
    """``+strategy=ps``: rank 0 owns the optimizer; workers push gradients and pull weights each step."""

    bucket_mb: float = 25.0  # flat-group size: one push and one pull per group and worker


@register
class Ps(Strategy):
    name, Config, phase, engine = "ps", PsConfig, "partition", "ps"
    group, group_why = "partition", "each is a data-parallel / ZeRO stage; select one"

    def validate(self, c: PsConfig, cfg) -> None:
        if c.bucket_mb <= 0:
            raise ConfigError(f"strategy.ps.bucket_mb={c.bucket_mb} must be > 0")
        if cfg.engine.name != "memopt":
            raise ConfigError(f"strategy ps is memopt's own engine; engine={cfg.engine.name} has no parameter server: "
                              "use engine=memopt, or +strategy=ddp with that engine")
        bf16 = cfg.strategy.bf16
        if bf16 is not None and bf16.params != "fp32":
            raise ConfigError(f"strategy.bf16.params={bf16.params} with strategy ps is not built: the server's fp32 master "
                              "would need its own copy per pull; use strategy.bf16.params=fp32 (autocast)")

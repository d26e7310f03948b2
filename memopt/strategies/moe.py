"""``+strategy=moe``: the MLP of every k-th block becomes a Mixture-of-Experts layer
(``memopt/models/moe.py``: Switch with top_k=1, GShard with top_k=2), experts split over the
expert-parallel dimension ``parallel.ep``.

Unlike the other strategies it changes the model, not only where bytes live: the parity references
are the dense MLP (one expert) and a float64 gating reference (tests/moe/). Applied first among the
model-phase strategies (order 0), so that flash_attn / ckpt / act_offload wrap the MoE blocks as
they wrap dense ones. Its load-balancing and z-loss terms reach the objective through
``Model.aux_loss``, its routing statistics the run records through ``Model.step_metrics``, and the
FLOP count (active experts only) and parameter count through the ``flops_per_token`` /
``num_params`` hooks below (``memopt.compose``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from memopt.errors import ConfigError
from memopt.models import model_class
from memopt.models.moe import MoE, RoutingStats
from memopt.parallel.dims import expected_world, resolve_sizes
from memopt.strategies.base import Build, Strategy, register


@dataclass
class MoEConfig:
    """``+strategy=moe``: which blocks get experts, how tokens are routed, and the router losses."""

    num_experts: int = 4  # E (divisible by parallel.ep)
    top_k: int = 1  # experts per token: 1 = Switch, 2 = GShard (weights renormalised for k >= 2)
    every_k_layers: int = 1  # blocks k-1, 2k-1, ... get experts (1: every block)
    capacity_factor: float = 1.25  # training: slots per expert = ceil(factor * tokens * top_k / E)
    eval_capacity_factor: float = 2.0  # the same in eval mode
    min_capacity: int = 4  # slots per expert at least
    drop_tokens: bool = True  # false: dropless (capacity = the largest expert load)
    aux_loss_coef: float = 0.01  # load-balancing loss weight (Switch: 1e-2)
    z_loss_coef: float = 0.001  # router z-loss weight (ST-MoE: 1e-3)
    d_ff: int | None = None  # expert hidden width; null: the model's d_ff


def moe_blocks(opts: MoEConfig, n_layer: int) -> list[int]:
    """Indices of the blocks that get experts: every k-th block counting from 1 (k-1, 2k-1, ...)."""
    return [i for i in range(n_layer) if (i + 1) % opts.every_k_layers == 0]


@register
class MoEStrategy(Strategy):
    name, Config, phase, order = "moe", MoEConfig, "model", 0
    uses = ("ep",)  # experts are split over parallel.ep

    def validate(self, c: MoEConfig, cfg) -> None:
        p = "strategy.moe"
        if c.num_experts < 1:
            raise ConfigError(f"{p}.num_experts={c.num_experts} must be >= 1")
        if not 1 <= c.top_k <= c.num_experts:
            raise ConfigError(f"{p}.top_k={c.top_k} must be between 1 and {p}.num_experts={c.num_experts}: "
                              f"a token cannot use more experts than exist; lower top_k or raise num_experts")
        if not 1 <= c.every_k_layers <= cfg.model.n_layer:
            raise ConfigError(f"{p}.every_k_layers={c.every_k_layers} must be between 1 and model.n_layer="
                              f"{cfg.model.n_layer} (at least one block gets experts)")
        for f in ("capacity_factor", "eval_capacity_factor"):
            if getattr(c, f) <= 0:
                raise ConfigError(f"{p}.{f}={getattr(c, f)} must be > 0 (1.0 gives each expert its even share of "
                                  f"the tokens); use {p}.drop_tokens=false for dropless routing")
        if c.min_capacity < 1:
            raise ConfigError(f"{p}.min_capacity={c.min_capacity} must be >= 1")
        for f in ("aux_loss_coef", "z_loss_coef"):
            if getattr(c, f) < 0:
                raise ConfigError(f"{p}.{f}={getattr(c, f)} must be >= 0 (0 disables the loss)")
        if cfg.model.arch != "gpt":
            raise ConfigError(f"strategy moe has GELU experts (the GPT's MLP); model.arch={cfg.model.arch!r} has a "
                              "SwiGLU MLP, and SwiGLU experts (Mixtral's) are not built: use model.arch=gpt (e.g. "
                              "model=moe_tiny) or drop +strategy=moe")
        if c.d_ff is not None and c.d_ff < 1:
            raise ConfigError(f"{p}.d_ff={c.d_ff} must be >= 1, or null for model.d_ff")
        ep = resolve_sizes(cfg.parallel, expected_world(cfg))["ep"]  # refuses an ep that does not divide the world
        if c.num_experts % ep:
            raise ConfigError(f"{p}.num_experts={c.num_experts} is not divisible by parallel.ep={ep}: each "
                              f"expert-parallel rank holds num_experts / ep experts; use a multiple of {ep} experts "
                              f"or an ep that divides {c.num_experts}")

    architecture = True  # model.pt records the options; memopt.load_model rebuilds the layers

    def apply(self, model, c: MoEConfig, build: Build) -> None:
        with torch.device("meta"):  # like the model: the engine materialises and initialises by name
            _install(model, c, build.cfg.model, ep=build.dims.ep, stats=RoutingStats(c.num_experts, build.dims.dp))

    def install(self, model, c: MoEConfig, model_cfg) -> None:
        """Every expert on this process, no statistics (inference from model.pt)."""
        _install(model, c, model_cfg)

    # counts from the config (memopt.compose.num_params / flops_per_token fold these in) ---------------
    def num_params(self, n: int, c: MoEConfig, cfg) -> int:
        """Total parameters: each MoE block trades its MLP for a router and E experts."""
        return n + len(moe_blocks(c, cfg.model.n_layer)) * _delta(c, cfg, c.num_experts)

    def active_params(self, n: int, c: MoEConfig, cfg) -> int:
        """Parameters a token meets: each MoE block's router and top_k experts in place of the MLP."""
        return n + len(moe_blocks(c, cfg.model.n_layer)) * _delta(c, cfg, c.top_k)

    def flops_per_token(self, f: float, c: MoEConfig, cfg) -> float:
        """Training FLOPs per token with only the top_k active experts (and the router) counted: 6 x the
        change in parameters a token meets (capacity padding is not useful work and is not counted)."""
        return f + 6.0 * (self.active_params(0, c, cfg))


def _install(model, c: MoEConfig, mc, ep=None, stats=None) -> None:
    """An MoE layer in the ``mlp`` slot of blocks k-1, 2k-1, ... (on the current default device)."""
    for i in moe_blocks(c, len(model.blocks)):
        model.set_slot(i, "mlp", MoE(
            mc.d_model, c.d_ff or mc.ff, c.num_experts, c.top_k, c.capacity_factor, c.eval_capacity_factor,
            c.min_capacity, c.drop_tokens, c.aux_loss_coef, c.z_loss_coef, mc.bias, mc.dropout,
            ep=ep, stats=stats, name=f"block{i}"))


def _delta(c: MoEConfig, cfg, experts: int) -> int:
    """Parameters a block gains when its MLP becomes a router + ``experts`` experts."""
    cls, mc = model_class(cfg.model), cfg.model
    return mc.d_model * c.num_experts + experts * cls.mlp_params(mc, c.d_ff or mc.ff) - cls.mlp_params(mc)

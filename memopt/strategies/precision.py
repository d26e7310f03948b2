"""Mixed precision: fp16 with dynamic loss scaling, bf16, and fp32 master weights.

Two forms, chosen by ``params``:
- ``params=fp32``: weights stay fp32 and the forward runs under ``torch.autocast`` (PyTorch AMP).
  Saves activation bytes only.
- ``params=fp16|bf16``: the model's weights and gradients are low precision and the optimizer keeps
  fp32 master weights (Micikevicius et al. 2018; DeepSpeed's fp16/bf16 modes). Saves parameter and
  gradient bytes; the master copy is counted with the optimizer states.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from memopt.errors import ConfigError
from memopt.strategies.base import Strategy, register


@dataclass
class Fp16Config:
    """fp16 compute with dynamic loss scaling (DeepSpeed's semantics, so the baselines match).

    The scale starts at ``init_scale``. A step whose gradients hold inf/NaN is skipped; after
    ``hysteresis`` such steps the scale is multiplied by ``backoff_factor`` (never below
    ``min_scale``). After ``growth_interval`` clean steps since the last overflow it grows by
    ``growth_factor``.
    """

    params: str = "fp16"  # fp16 (fp16 weights + fp32 master) | fp32 (fp32 weights, autocast only)
    init_scale: float = 65536.0  # DeepSpeed initial_scale_power=16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000  # DeepSpeed loss_scale_window
    hysteresis: int = 2  # overflows tolerated before the scale backs off (DeepSpeed hysteresis)
    min_scale: float = 1.0  # DeepSpeed min_loss_scale


@dataclass
class Bf16Config:
    """bf16 compute. No loss scaling: bf16 has fp32's exponent range."""

    params: str = "fp32"  # fp32 (autocast only) | bf16 (bf16 weights + fp32 master: the memory-saving form)


class DynamicLossScaler:
    """Loss scale that backs off on overflow and grows after a clean window (see Fp16Config)."""

    def __init__(self, cfg: Fp16Config):
        self.cfg = cfg
        self.scale = float(cfg.init_scale)
        self._hysteresis_left = cfg.hysteresis
        self._clean_steps = 0
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.skipped_steps += 1
            self._clean_steps = 0
            if self._hysteresis_left <= 1:
                self.scale = max(self.scale * self.cfg.backoff_factor, self.cfg.min_scale)
            else:
                self._hysteresis_left -= 1
            return
        self._clean_steps += 1
        if self._clean_steps % self.cfg.growth_interval == 0:
            self.scale *= self.cfg.growth_factor
            self._hysteresis_left = self.cfg.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left, "clean": self._clean_steps, "skipped": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._hysteresis_left = float(state["scale"]), int(state["hysteresis_left"])
        self._clean_steps, self.skipped_steps = int(state["clean"]), int(state["skipped"])


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Precision:
    """What the loop needs to know about dtypes: resolved from the fp16/bf16 strategy configs."""

    param_dtype: torch.dtype = torch.float32  # dtype of the model's weights and grads
    compute_dtype: torch.dtype = torch.float32  # autocast dtype (fp32: no autocast)
    scaler: DynamicLossScaler | None = None

    @property
    def master_weights(self) -> bool:
        return self.param_dtype != torch.float32

    @property
    def name(self) -> str:
        return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[self.compute_dtype]

    @classmethod
    def from_strategies(cls, fp16: Fp16Config | None, bf16: Bf16Config | None) -> "Precision":
        """The dtypes and scaler of the selected precision strategy (validated by ``Fp16`` / ``Bf16``)."""
        if fp16 is not None:
            return cls(_DTYPES[fp16.params], torch.float16, DynamicLossScaler(fp16))
        if bf16 is not None:
            return cls(_DTYPES[bf16.params], torch.bfloat16, None)
        return cls()

    @classmethod
    def of(cls, cfg) -> "Precision":
        return cls.from_strategies(getattr(cfg.strategy, "fp16", None), getattr(cfg.strategy, "bf16", None))

    def autocast(self, device: torch.device):
        """Context manager for the forward pass. Without autocast's weight cache: it keeps the cast copy of
        every parameter until the forward ends, so under ZeRO-3 (parameters gathered one layer at a time)
        a forward held a compute-dtype copy of the whole model (Llama-3-70B on 8 ranks: 131 GiB a rank,
        planned), and checkpointing could not free the copies a checkpointed block's matmuls saved. Each
        use casts again instead (the same values; one cast per use, what a single-use weight costs anyway)."""
        return torch.autocast(device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32,
                              cache_enabled=False)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0


_GROUP_WHY = "both set the parameter and compute dtype; choose one (+strategy=fp16 or +strategy=bf16)"


@register
class Fp16(Strategy):
    name, Config, phase, group, group_why = "fp16", Fp16Config, "precision", "precision", _GROUP_WHY

    def validate(self, f: Fp16Config, cfg) -> None:
        if f.params not in ("fp16", "fp32"):
            raise ConfigError(f"strategy.fp16.params={f.params!r} is not one of: fp16, fp32")
        if f.init_scale <= 0 or f.min_scale <= 0 or not 0 < f.backoff_factor < 1 or f.growth_factor <= 1:
            raise ConfigError("strategy.fp16 needs init_scale > 0, min_scale > 0, 0 < backoff_factor < 1, growth_factor > 1")
        if f.growth_interval < 1 or f.hysteresis < 1:
            raise ConfigError("strategy.fp16.growth_interval and strategy.fp16.hysteresis must be >= 1")


@register
class Bf16(Strategy):
    name, Config, phase, group, group_why = "bf16", Bf16Config, "precision", "precision", _GROUP_WHY

    def validate(self, b: Bf16Config, cfg) -> None:
        if b.params not in ("bf16", "fp32"):
            raise ConfigError(f"strategy.bf16.params={b.params!r} is not one of: bf16, fp32")

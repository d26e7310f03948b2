"""The optimizer step every memopt strategy shares: unscale, overflow skip, clip, AdamW, copy back.

With low-precision parameters the optimizer owns fp32 master weights (counted as ``optim`` bytes)
and fp32 copies of the gradients; the AdamW math always runs in fp32. The learning-rate schedule
(linear warm-up, cosine decay) lives here too so every engine uses the same numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from memopt.strategies.precision import Precision, grads_finite


def lr_at(step: int, cfg, max_steps: int) -> float:
    """Learning rate for 0-based ``step``: linear warm-up then cosine decay to lr * min_lr_ratio."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def param_groups(named_params, weight_decay: float):
    """Decay matrices and embeddings (ndim >= 2), not biases or LayerNorm weights (GPT-2/nanoGPT)."""
    seen, decay, no_decay = set(), [], []
    for _, p in named_params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    return decay, no_decay


def make_adamw(decay, no_decay, cfg) -> torch.optim.AdamW:
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype == torch.float32 for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused or None)


@dataclass
class StepResult:
    skipped: bool
    grad_norm: float
    loss_scale: float


class MixedPrecisionAdamW:
    """AdamW over fp32 weights: the model's own when they are fp32, else fp32 master copies."""

    def __init__(self, model: torch.nn.Module, cfg, precision: Precision, tracker=None):
        self.cfg, self.precision, self.tracker = cfg, precision, tracker
        decay, no_decay = param_groups(model.named_parameters(), cfg.weight_decay)
        self.params = decay + no_decay
        if precision.master_weights:
            with _category(tracker, "optim"):
                self.master = [p.detach().float().clone() for p in self.params]
            n = len(decay)
            self.optimizer = make_adamw(self.master[:n], self.master[n:], cfg)
        else:
            self.master = None
            self.optimizer = make_adamw(decay, no_decay, cfg)

    def fp32_params(self) -> list[torch.Tensor]:
        return self.master if self.master is not None else self.params

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        scale = self.precision.loss_scale
        targets = self.fp32_params()
        if self.master is not None:
            with _category(self.tracker, "grads"):
                for m, p in zip(self.master, self.params):
                    m.grad = p.grad.float() if p.grad is not None else None
                    p.grad = None
        grads = [t.grad for t in targets if t.grad is not None]
        if self.precision.scaler is not None:
            finite = grads_finite(grads)
            self.precision.scaler.update(overflow=not finite)
            if not finite:
                self.zero_grad()
                return StepResult(True, float("nan"), scale)
            if scale != 1.0:
                torch._foreach_mul_(grads, 1.0 / scale)
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(targets, clip, foreach=True)) if grads else 0.0
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        with _category(self.tracker, "optim"):
            self.optimizer.step()
        if self.master is not None:
            for m, p in zip(self.master, self.params):
                p.copy_(m)
        self.zero_grad()
        return StepResult(False, norm, scale)

    def zero_grad(self) -> None:
        for t in self.params + (self.master or []):
            t.grad = None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()


class _category:
    def __init__(self, tracker, name):
        self.ctx = tracker.category(name) if tracker is not None else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *a):
        if self.ctx is not None:
            return self.ctx.__exit__(*a)
        return False

"""The learning-rate schedule every engine uses: linear warm-up, then cosine decay (or constant)."""
from __future__ import annotations

import math


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

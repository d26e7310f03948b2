"""The chunk engine's options that are left to it (``null`` in ``strategy.chunk``), chosen from the
device budget, the world and the chunk size before anything is allocated; an explicit value wins.

Why: PatrickStar's fixed defaults (one all-gather of a group of W chunks, a warm-up chunk budget of
10% of the device) refuse large models on many ranks at their first module: gpt_10b on 8 V100s
gathers 8 chunks of ~0.9 GiB at once into a 2.6 GiB warm-up budget. What a warm-up moment holds is
known from the layout alone: the chunks of the communication units its tensors live in (a Linear's
weight and bias can sit in two units) and, under gradient accumulation, their gradient companions.

* communication form (``mem_saving_comm``): one all-gather / reduce-scatter per group of W chunks
  (fewer, larger collectives) when two groups fit PatrickStar's default warm-up budget; else one
  broadcast / reduce per chunk (a unit of one chunk).
* warm-up share (``warmup_gpu_chunk_mem_ratio``): PatrickStar's 0.1, raised to hold two units with
  their gradients (rounded up to a hundredth), at most 1.
* a device budget that cannot hold one unit with its gradients is refused here, naming the budget
  that would (a refusal before allocation, not an out-of-memory at the first module).
"""
from __future__ import annotations

import math

from memopt.errors import ConfigError

DEFAULT_WARMUP_SHARE = 0.1  # PatrickStar's warmup_gpu_chunk_mem_ratio
GiB = 2**30


def moment_bytes(unit_chunks: int, chunk_bytes: int, grad_factor: int) -> int:
    """The most chunk bytes a warm-up moment holds: two units of ``unit_chunks`` chunks, with gradients."""
    return 2 * unit_chunks * chunk_bytes * grad_factor


def comm_form(ccfg, world: int, budget: int, chunk_bytes: int, grad_factor: int) -> bool:
    """``mem_saving_comm`` as given, or chosen (True: one chunk per unit; see the module docstring)."""
    if ccfg.mem_saving_comm is not None:
        return bool(ccfg.mem_saving_comm)
    if world <= 1:
        return False
    share = ccfg.warmup_gpu_chunk_mem_ratio or DEFAULT_WARMUP_SHARE
    return moment_bytes(world, chunk_bytes, grad_factor) > share * budget


def warmup_share(ccfg, budget: int, unit_chunks: int, chunk_bytes: int, grad_factor: int) -> float:
    """``warmup_gpu_chunk_mem_ratio`` as given, or the smallest share >= 0.1 that holds two units.
    Refuses (``ConfigError``) a device budget below one unit with its gradients."""
    one_unit = unit_chunks * chunk_bytes * grad_factor
    if budget < one_unit:
        raise ConfigError(
            f"strategy.chunk.device_budget_gb={budget / GiB:.4g} cannot hold one communication unit ({unit_chunks} "
            f"chunk(s) of {chunk_bytes} B{' with their gradients' if grad_factor > 1 else ''}: {one_unit} B); "
            f"set it to at least {math.ceil(one_unit / GiB * 1e4) / 1e4:.4g}, or lower strategy.chunk.chunk_size"
            + (" or set strategy.chunk.mem_saving_comm=true (units of one chunk)" if unit_chunks > 1 else ""))
    if ccfg.warmup_gpu_chunk_mem_ratio is not None:
        return ccfg.warmup_gpu_chunk_mem_ratio
    need = math.ceil(100 * moment_bytes(unit_chunks, chunk_bytes, grad_factor) / budget) / 100
    return min(1.0, max(DEFAULT_WARMUP_SHARE, need))

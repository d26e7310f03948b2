"""The chunk engine's options that are left to it (``null`` in ``strategy.chunk``), chosen from the
device budget, the world and the model's tensor sizes before anything is allocated; an explicit value
wins, and a bad one is refused here, before allocation, naming the value that would work.

Why: PatrickStar's fixed defaults (one all-gather of a group of W chunks, a warm-up chunk budget of
10% of the device) refuse large models on many ranks at their first module: gpt_10b on 8 V100s
gathers 8 chunks of ~0.9 GiB at once into a 2.6 GiB warm-up budget. What a warm-up moment holds is
known from the layout alone: the chunks of the communication units its tensors live in (a Linear's
weight and bias can sit in two units) and, under gradient accumulation, their gradient companions.

* chunk size (``chunk_size``), as PatrickStar searches its own: the aligned size c in [m, 4m] (m:
  the largest parameter) that minimises the bytes the busiest rank holds because of c (``chunk_cost``):

      ceil(trainable chunks / W) x c x (payload x g + 12) + ceil(frozen chunks / W) x c x payload
      + c x (2 x payload + 6)

  i.e. its model states with the packing's padding and the padding chunks that fill the last group
  of W (payload: 2 B in fp16/bf16, 4 in fp32; g: 1 under gradient reuse, 2 with a companion; 12: fp32
  master, momentum, variance), plus what grows with one chunk: the host step's two staging chunks of
  the payload dtype (2 x payload B per element, ``staging.py``) and half an optimizer group (6 B per element), the expected part of the device margin that
  no whole group fills (Hybrid Adam places whole groups of 12 B per element). Bounded by the device
  budget D: two units of one chunk with their gradients (what a warm-up moment may hold) at most D.
  Why: least padding alone (the search before) packs 3 blocks of gpt_10b (139 layers, 8 ranks) in a
  chunk of 604M elements (0.68% padding), whose optimizer group of 6.75 GiB no V100's margin holds;
  this cost chooses the embedding's size (206M elements, groups of 2.3 GiB, 2.28% padding): 1.6 points
  more padding cost the busiest rank less than the rounding of groups three times larger. Where no
  margin matters (small models on one rank) it is the least padding (gpt_tiny and gpt_small keep their
  sizes). The non-model peak is not known at build (the warm-up measures it): a plan finds the moments
  where activations leave less than a unit, and then no chunk of at least m would help much.
* communication form (``mem_saving_comm``): one all-gather / reduce-scatter per group of W chunks
  (fewer, larger collectives) when two groups fit PatrickStar's default warm-up budget; else one
  broadcast / reduce per chunk (a unit of one chunk).
* warm-up share (``warmup_gpu_chunk_mem_ratio``): PatrickStar's 0.1, raised to hold two units with
  their gradients (rounded up to a hundredth), at most 1.
* a device budget that cannot hold one unit with its gradients is refused here, naming the budget
  that would and the chunk size that would (a refusal before allocation, not an out-of-memory at the
  first module); so is an explicit chunk size below the largest parameter.
"""
from __future__ import annotations

import math

from memopt.errors import ConfigError

DEFAULT_WARMUP_SHARE = 0.1  # PatrickStar's warmup_gpu_chunk_mem_ratio
GiB = 2**30
OPTIM_BYTES = 12  # fp32 master, momentum, variance per element of a trainable chunk
ROUNDING_BYTES = 6  # half an optimizer group: the expected part of the device margin no whole group fills


def chunk_cost(counts: list[int], c: int, world: int, payload: int, grad_factor: int, expert_world: int | None = None) -> int:
    """Bytes the busiest rank holds because of chunk size ``c`` (module docstring). ``counts``: the chunks
    of each packing group (trainable dense, trainable expert, frozen), as ``search_chunk_size`` passes them;
    ``expert_world``: with expert parallelism, the ranks the expert chunks are partitioned over (a list of
    their own, comm.py), else None (one list with the dense ones)."""
    dense, expert, frozen = (list(counts) + [0, 0, 0])[:3]
    trainable = (math.ceil((dense + expert) / world) if expert_world is None else
                 math.ceil(dense / world) + math.ceil(expert / expert_world))
    fixed = math.ceil(frozen / world)
    staging = 2 * payload  # the host step's two staging buffers of the payload dtype (staging.py)
    return c * (trainable * (payload * grad_factor + OPTIM_BYTES) + fixed * payload + staging + ROUNDING_BYTES)


def chunk_size(given: int | None, groups: list[list[tuple[str, int]]], world: int, payload: int, grad_factor: int,
               budget: int | None, expert_world: int | None = None) -> int:
    """``strategy.chunk.chunk_size`` when given (refused, naming what would work, when a parameter does not
    fit in one chunk), else the size the module docstring's rule chooses. ``groups``: (name, elements) of
    the parameters of each packing group, in registration order; ``budget``: the device budget in bytes
    (None: no bound)."""
    from functools import partial

    from memopt.engines.chunk.manager import ALIGN, search_chunk_size

    sizes = [[k for _, k in g] for g in groups]

    def chosen() -> int:
        hi = None if budget is None else budget // (2 * payload * grad_factor)
        return search_chunk_size(sizes, cost=partial(chunk_cost, world=world, payload=payload, grad_factor=grad_factor,
                                                        expert_world=expert_world), hi=hi)

    if not given:
        return chosen()
    over = next(((n, k) for g in groups for n, k in g if k > given), None)
    if over is not None:
        name, big = max(((n, k) for g in groups for n, k in g), key=lambda x: x[1])
        raise ConfigError(
            f"parameter {over[0]} has {over[1]} elements, more than strategy.chunk.chunk_size={given}: a tensor must fit in one "
            f"chunk; set it to at least {big} (the largest parameter, {name}; a multiple of {ALIGN}: "
            f"{math.ceil(big / ALIGN) * ALIGN}) or to null (the engine's choice here: {chosen()})")
    return given


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


def warmup_share(ccfg, budget: int, unit_chunks: int, chunk_bytes: int, grad_factor: int,
                 chunk_fix: str = "lower strategy.chunk.chunk_size") -> float:
    """``warmup_gpu_chunk_mem_ratio`` as given, or the smallest share >= 0.1 that holds two units.
    Refuses (``ConfigError``) a device budget below one unit with its gradients (``chunk_fix``: what the
    refusal says of the chunk size, ``chunk_size_fix``'s answer when the caller knows the sizes)."""
    one_unit = unit_chunks * chunk_bytes * grad_factor
    if budget < one_unit:
        raise ConfigError(
            f"strategy.chunk.device_budget_gb={budget / GiB:.4g} cannot hold one communication unit ({unit_chunks} "
            f"chunk(s) of {chunk_bytes} B{' with their gradients' if grad_factor > 1 else ''}: {one_unit} B); "
            f"set it to at least {math.ceil(one_unit / GiB * 1e4) / 1e4:.4g}, or {chunk_fix}"
            + (" or set strategy.chunk.mem_saving_comm=true (units of one chunk)" if unit_chunks > 1 else ""))
    if ccfg.warmup_gpu_chunk_mem_ratio is not None:
        return ccfg.warmup_gpu_chunk_mem_ratio
    need = math.ceil(100 * moment_bytes(unit_chunks, chunk_bytes, grad_factor) / budget) / 100
    return min(1.0, max(DEFAULT_WARMUP_SHARE, need))


def chunk_size_fix(budget: int, unit_chunks: int, payload: int, grad_factor: int, largest: int) -> str:
    """What a refusal of a unit over the budget says of the chunk size: the largest one whose unit fits
    (never below the largest parameter), or that none does."""
    from memopt.engines.chunk.manager import ALIGN

    most = budget // (unit_chunks * payload * grad_factor) // ALIGN * ALIGN
    if most >= largest:
        return f"set strategy.chunk.chunk_size at most {most} (its unit then fits; the largest parameter has {largest} elements)"
    return (f"no chunk size helps (a chunk holds at least the largest parameter, {largest} elements: "
            f"{unit_chunks * largest * payload * grad_factor} B per unit)")

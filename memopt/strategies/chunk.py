"""``+strategy=chunk`` (PatrickStar's chunk memory manager) and its add-ons ``static_partition`` and
``hybrid_adam``: their typed options and rules. The engine that implements them is
``memopt/engines/chunk/`` (chosen when ``engine=memopt`` and ``chunk`` is selected); the
``hybrid_adam`` / ``hybrid_adam_bf16`` presets pull ``chunk`` in through their defaults lists. The ratio names and defaults
are PatrickStar's ``mem_tracer`` settings (its optimization-options page).

Budgets, in the order they are derived:

* device capacity ``C`` = ``hardware.device_memory_gb`` (read from the machine when unset: the GPU's
  memory, or the host RAM on a CPU-only machine).
* device budget ``D`` = ``device_budget_gb`` when set, else ``C * overall_gpu_mem_ratio`` (null: 0.95,
  not PatrickStar's 0.8: memopt's tracker counts every tensor the run makes, so the reserve only has to
  hold what no tracker sees: the CUDA context, NCCL's buffers, the allocator's fragmentation). Everything
  the engine places on the compute device (chunks) plus what the run allocates there besides them
  (activations, temporaries: "non-model" memory) should fit in ``D``.
* warm-up chunk budget ``W`` = ``warmup_gpu_chunk_mem_ratio * D`` (null: 0.1, raised to hold two
  communication units, ``engines/chunk/defaults.py``): the most chunk bytes on the device
  during the warm-up iteration (the first optimizer step, all micro-steps included), while the
  tracer records the non-model memory at every moment. With ``static_partition`` it is the budget
  for the whole run.
* dynamic chunk budget at moment t (after warm-up) = ``D - nonmodel(t) - optimizer chunk bytes kept
  on the device`` (Hybrid Adam). The engine enforces it on its own placement accounting; when the
  chunks a moment needs do not fit, it raises ``ChunkOutOfMemoryError`` naming the moment.
* host budget = ``host_memory_gb * overall_cpu_mem_ratio``: checked once at build (every chunk but
  the optimizer groups made on the device at build may be on the host). null: PatrickStar's 0.8, or
  the whole host RAM when a plan decided the placement (``hybrid_adam.device_groups`` set: the plan
  counted the node's host peak exactly; engines/chunk/engine.py ``check_host_budget``).

Note: PatrickStar defines the warm-up budget as a fraction of the GPU's capacity; here it is a
fraction of ``D`` so that a test can shrink the whole device with one number.
"""
from __future__ import annotations

from dataclasses import dataclass

from memopt.errors import ConfigError
from memopt.strategies.base import Strategy, register


@dataclass
class ChunkConfig:
    """``+strategy=chunk``: parameters and optimizer states in fixed-size chunks moved whole between
    the host and the device by a runtime memory tracer (PatrickStar, Fang et al. 2021)."""

    chunk_size: int | None = None  # elements per chunk; null/0: search (see manager.search_chunk_size)
    device_budget_gb: float | None = None  # null: hardware.device_memory_gb * overall_gpu_mem_ratio
    # chunk bytes on the device during warm-up / D; null: 0.1 raised to hold two communication units
    # (engines/chunk/defaults.py)
    warmup_gpu_chunk_mem_ratio: float | None = None
    overall_gpu_mem_ratio: float | None = None  # D / device capacity (when device_budget_gb is null); null: 0.95
    # host budget / host RAM (the build's check); null: PatrickStar's 0.8, or 1.0 when the placement is
    # decided (strategy.hybrid_adam.device_groups set by a plan that counted the node's host exactly)
    overall_cpu_mem_ratio: float | None = None
    margin_use_ratio: float = 0.8  # Hybrid Adam: share of the device margin given to optimizer chunks
    async_mem_monitor: bool = False  # sample non-model memory in a thread (matters without a tracker; see tracer.py)
    monitor_interval_ms: float = 1.0  # sampling period of the async monitor
    # distributed options (2+ ranks; see comm.py)
    # units of one chunk: N broadcasts / N reduces instead of group all-gather / reduce-scatter; null: the
    # group when two fit 0.1 of D, else one chunk (engines/chunk/defaults.py)
    mem_saving_comm: bool | None = None
    mem_cache: int = 2  # released units whose remote buffers stay allocated for reuse (FIFO); 0: off
    release_after_init: bool = False  # every rank fills every chunk, then frees the remote ones (PatrickStar's serial init)
    res_check: bool = False  # after init, gather every chunk and compare it bit for bit with the serial init
    cpu_adam_impl: str = "auto"  # CPUAdamW implementation for host-side updates: auto | cpp | torch
    # gradients written over their parameters in the chunks when trainer.grad_accum == 1 (PatrickStar's
    # reuse: no gradient bytes of their own); false, or accumulation: a gradient companion chunk
    grad_reuse: bool = True


@dataclass
class StaticPartitionConfig:
    """``+strategy=static_partition``: the device holds at most the warm-up chunk budget
    (``warmup_gpu_chunk_mem_ratio * D``) for the whole run; lower throughput, no OOM surprises."""


@dataclass
class HybridAdamConfig:
    """``+strategy=hybrid_adam`` (preset: chunk + Hybrid Adam + fp16): after warm-up, as many
    optimizer chunk groups (fp32 master, momentum, variance) as ``margin_use_ratio`` of the device
    margin allows stay on the device and are updated there; the rest are updated on the host by
    ``CPUAdamW``. margin = D - max_t nonmodel(t) - the param/grad chunk bytes that may be on the
    device at once (all of them, or the static budget)."""

    max_device_chunks: int | None = None  # optional cap on the optimizer chunk groups kept on the device
    # optimizer groups made on the device at build, before step 0 (a plan's decision: the warm-up step
    # checks it and moves back, with a warning naming the bytes, what its measured margin cannot hold);
    # null: none before step 0, the warm-up decides (PatrickStar)
    device_groups: int | None = None


@register
class Chunk(Strategy):
    name, Config, phase, order, engine = "chunk", ChunkConfig, "partition", -1, "chunk"
    excludes = ("cpu_offload",)
    excludes_why = "the chunk engine is its own partitioner and keeps optimizer states on the host itself"
    group, group_why = "partition", "the chunk engine is its own partitioner (and keeps optimizer states on the host)"

    def validate(self, chunk: ChunkConfig, cfg) -> None:
        if chunk.chunk_size is not None and chunk.chunk_size < 0:
            raise ConfigError(f"strategy.chunk.chunk_size={chunk.chunk_size} must be > 0 (or null/0 to search a size)")
        if chunk.device_budget_gb is not None and chunk.device_budget_gb <= 0:
            raise ConfigError(f"strategy.chunk.device_budget_gb={chunk.device_budget_gb} must be > 0 (or null)")
        for name in ("warmup_gpu_chunk_mem_ratio", "overall_gpu_mem_ratio", "overall_cpu_mem_ratio", "margin_use_ratio"):
            v = getattr(chunk, name)
            if v is not None and not 0 < v <= 1:
                auto = " or null (the engine picks the smallest share >= 0.1 that holds two communication units)" \
                    if name == "warmup_gpu_chunk_mem_ratio" else ""
                raise ConfigError(f"strategy.chunk.{name}={v} must be in (0, 1]{auto}")
        if chunk.mem_cache < 0:
            raise ConfigError(f"strategy.chunk.mem_cache={chunk.mem_cache} must be >= 0")
        if chunk.monitor_interval_ms <= 0:
            raise ConfigError(f"strategy.chunk.monitor_interval_ms={chunk.monitor_interval_ms} must be > 0")
        if chunk.cpu_adam_impl not in ("auto", "cpp", "torch"):
            raise ConfigError(f"strategy.chunk.cpu_adam_impl={chunk.cpu_adam_impl!r} is not one of: auto, cpp, torch")
        if chunk.res_check and not chunk.release_after_init:
            raise ConfigError("strategy.chunk.res_check=true needs strategy.chunk.release_after_init=true "
                              "(it checks that distributed init equals serial init)")


@register
class StaticPartition(Strategy):
    name, Config, phase, engine = "static_partition", StaticPartitionConfig, "offload", "chunk"
    requires, requires_why = ("chunk",), "the chunk engine"


@register
class HybridAdam(Strategy):
    name, Config, phase, engine = "hybrid_adam", HybridAdamConfig, "offload", "chunk"
    requires, requires_why = ("chunk",), "the chunk engine; or the +strategy=hybrid_adam preset"

    def validate(self, hybrid: HybridAdamConfig, cfg) -> None:
        if hybrid.device_groups is not None and hybrid.device_groups < 0:
            raise ConfigError(f"strategy.hybrid_adam.device_groups={hybrid.device_groups} must be >= 0 (or null)")
        if hybrid.max_device_chunks is not None and hybrid.max_device_chunks < 0:
            raise ConfigError(f"strategy.hybrid_adam.max_device_chunks={hybrid.max_device_chunks} must be >= 0 (or null)")

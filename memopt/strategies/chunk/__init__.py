"""The chunk engine (PatrickStar): chunked parameters and optimizer states, a runtime memory
tracer, Belady eviction, static partition and Hybrid Adam (``+strategy=chunk``, ``static_partition``,
``hybrid_adam`` / ``hybrid_adam_bf16`` presets).

Files, one job each:
  config.py       typed configs (ChunkConfig, StaticPartitionConfig, HybridAdamConfig), budgets, validation
  chunk.py        Chunk (device/host storage, moves whole, gradient companion) and TensorState
  tracer.py       runtime memory tracer: per-moment non-model memory and chunk access order (warm-up)
  manager.py      chunk list layout, chunk-size search, budget enforcement, Belady/LRU eviction, OOM diagnosis
  hooks.py        module pre/post forward and backward hooks driving tensor states (tied/frozen params)
  hybrid_adam.py  AdamW over fp32 master/momentum/variance chunks: on the device (margin) or the host (CPUAdamW)
  engine.py       ChunkEngine(Engine), build_chunk_engine (called by compose.build), init and res_check
  comm.py         2+ ranks: chunk groups of world size, owners, all-gather / reduce-scatter (or broadcast /
                  reduce with mem_saving_comm), the mem_cache queue

``build_chunk_engine`` is imported lazily so that loading the configs stays cheap.
"""
from memopt.strategies.chunk.config import ChunkConfig, HybridAdamConfig, StaticPartitionConfig

__all__ = ["ChunkConfig", "HybridAdamConfig", "StaticPartitionConfig", "build_chunk_engine"]


def build_chunk_engine(cfg, device, ctx, tracker, model_on_meta, precision):
    from memopt.strategies.chunk.engine import build_chunk_engine as _build

    return _build(cfg, device, ctx, tracker, model_on_meta, precision)

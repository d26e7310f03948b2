"""The chunk engine (PatrickStar): chunked parameters and optimizer states, a runtime memory
tracer, Belady eviction, static partition and Hybrid Adam. It implements ``+strategy=chunk``,
``static_partition`` and ``hybrid_adam`` (options and rules: ``memopt/strategies/chunk.py``).

Files, one job each:
  chunk.py        Chunk (device/host storage, moves whole, gradients over the payload or in a companion) and TensorState
  tracer.py       runtime memory tracer: per-moment non-model memory and chunk access order (warm-up)
  manager.py      chunk list layout, chunk-size search, budget enforcement, Belady/LRU eviction, OOM diagnosis
  hooks.py        module pre/post forward and backward hooks driving tensor states (tied/frozen params)
  hybrid_adam.py  AdamW over fp32 master/momentum/variance chunks: on the device (margin) or the host (CPUAdamW)
  comm.py         2+ ranks: chunk groups of the dp_shard size (MoE experts with ep > 1: of the edp size), owners,
                  all-gather / reduce-scatter (or broadcast / reduce with mem_saving_comm), the mem_cache queue
  defaults.py     the options left null: communication form and warm-up share from budget, world and chunk size
  engine.py       ChunkEngine(Engine), build (the engine registry's entry), init and res_check
"""
from memopt.engines.chunk.engine import LABEL, NAME, PARALLEL, SUPPORTS, ChunkEngine, build, build_chunk_engine

__all__ = ["LABEL", "NAME", "PARALLEL", "SUPPORTS", "ChunkEngine", "build", "build_chunk_engine"]

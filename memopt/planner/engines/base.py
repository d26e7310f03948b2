"""The questions the planner's core asks an engine's wing, and the answers of an engine that needs
nothing beyond its own code on fake tensors (the memopt engine's, the pipeline's, the parameter
server's). A wing answers only what its engine changes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Wing:
    # (cfg, rank, world, limits, backend, ranks_per_node, **hint) -> a simulate_rank-shaped result, for an
    # engine that does not run on fake tensors (DeepSpeed: its buffers counted by its own rules)
    rules: Callable | None = None
    # (cfg, backend) -> a context factory (tracker -> context) around the fake step, or None: copies the
    # fake step must make explicit (FSDP2's CPU offload); raises PlanUnsupported where it cannot plan
    step_patch: Callable | None = None
    # a process group even for one rank, and its one-rank mesh (FSDP2)
    process_group_always: bool = False
    # (cfg, rank, world) -> the size buckets' packing, checked affine while extrapolating (None: no buckets)
    bucket_layout: Callable | None = None
    # the chunk engine: replayed at depth from a recorded step, its chunk layout checked, its ranks'
    # bytes unequal (the node's host is the sum of its ranks' layouts)
    chunks: bool = False
    # cfg -> the engine's own device budget in GB (None: none), a limit the hardware bound does not see
    device_budget: Callable | None = None

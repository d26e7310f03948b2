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
    # planning at depth (extrapolate.simulate), for an engine whose decisions are not affine in depth (the
    # chunk engine, engines/chunk/depth.py): (cfg, rank, world) -> the cfg its samples take (its searched
    # sizes pinned); (cfg, rank, world, limits, backend, depth | None, verify) -> the plan replayed at depth
    # from a recorded shallow step, or NotReplayed; (cfg, rank, world, depths, cache) -> why a window cannot
    # be extrapolated (the memopt engine's buckets too); (cfg, sim_a, sim_b, n1, n2, cache) -> why the engine's
    # decisions would not follow
    prepare: Callable | None = None
    replay: Callable | None = None
    window_check: Callable | None = None
    sample_check: Callable | None = None
    # (cfg, ranks, world) -> {rank: its layout}: ranks with equal layouts hold equal bytes, others differ
    # (the node's host is the sum of its ranks'); None: every rank of a stage holds what the simulated one does
    rank_layouts: Callable | None = None
    # cfg -> the engine's own device budget in GB (None: none), a limit the hardware bound does not see
    device_budget: Callable | None = None
    # every micro-batch between the first and the last of a step holds and counts what the second does
    # (simulate.sampled_micro_batches): the memopt engine's and FSDP2's loops. Not a pipeline (its schedule
    # runs on the last call, over all of them) nor the chunk engine (its warm-up traces every moment)
    micro_batches_repeat: bool = False
    # cfg -> True where every micro-batch runs the composed model's forward and backward and the engine only adds
    # its own work, so that work alone bounds the planned step (planner/model_work.py)
    model_bound: Callable | None = None
    # cfg -> (a name, a context) where the plan runs the model through the engine's own layer code (DeepSpeed's
    # ZeRO-3 linear, DeepSpeed-MoE): the model's work is counted inside it, and cached under the name; None: memopt's
    model_code: Callable | None = None


class NotReplayed(Exception):
    """A wing's replay does not apply (the reason says why; ``seconds``: what trying took)."""

    seconds: float = 0.0

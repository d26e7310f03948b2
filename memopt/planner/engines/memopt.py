"""The memopt engine's wing: whether its size buckets grow like the model (``Wing.window_check`` of ``extrapolate.simulate``).

ddp, zero1 and zero2 pack the gradients into flat groups of at most ``bucket_mb`` (``engines/memopt/
flat.plan_groups``), and a bucket's flat copy is a ``temp`` peak. While the whole model fits one
bucket that peak grows with depth; once the model fills several it stops at about ``bucket_mb``. A
shallow window then extrapolates a bucket as large as the deep model (moe_tiny at 36 blocks, ddp on 2
ranks: 54.6 MiB of device temp extrapolated from 6 and 8 blocks, 24.9 MiB simulated block by block),
and its three depths agree, so the window check does not see it. The bucket plan itself is cheap (the
engine's packing on meta parameters), so it is compared instead: the number of groups and the sizes
of the two largest must be affine over the window and the planned depth, as the chunk layout is.
zero3 (one group per block) and the other engines have no size buckets: nothing to check.
"""
from __future__ import annotations

from memopt.planner.engines.base import Wing


def bucket_layout(cfg, rank: int, world: int) -> dict | None:
    """{"groups", "largest", "two largest"} (elements) of this rank's flat groups, for each data-parallel
    dimension (MoE experts' groups prefixed "edp "); None when the run has no size buckets."""
    import torch

    from memopt.compose import model_on_meta
    from memopt.engines.memopt.flat import plan_groups
    from memopt.memory.tracker import NullTracker
    from memopt.planner.simulate import fake_world
    from memopt.strategies.precision import Precision
    from memopt.strategies.zero import selected_stage

    _, stage, opts = selected_stage(cfg)
    if stage == 3 or not getattr(opts, "bucket_mb", 0):
        return None
    with fake_world(cfg, rank, world) as dims:
        model = model_on_meta(cfg, torch.device("cpu"), dims, NullTracker())
        plan = plan_groups(model, stage, opts.bucket_mb, Precision.of(cfg).param_dtype, model.param_dims())
    out = {}
    plan = [(g, members, d) for g, members, d in plan if not g.startswith("frozen_")]  # frozen: no gradient buckets
    for dim in sorted({d or "" for _, _, d in plan}):  # "": the engine's own dimension; MoE experts: edp
        sizes = sorted((sum(p.numel() for _, p in members) for _, members, d in plan if (d or "") == dim), reverse=True)
        pre = f"{dim} " if dim else ""
        out.update({f"{pre}groups": len(sizes), f"{pre}largest": sizes[0], f"{pre}two largest": sum(sizes[:2])})
    return out


def bucket_inconsistency(layouts: list[dict], depths: tuple[int, ...]) -> str | None:
    """Why the bucket layouts at ``depths`` (the window, then the planned depth) are not affine in depth."""
    d0, d1 = depths[:2]
    for k in layouts[0]:
        x, y = layouts[0][k], layouts[1][k]
        if any(abs(x + (y - x) * (d - d0) / (d1 - d0) - lay.get(k, 0)) > 0.5 for d, lay in zip(depths[2:], layouts[2:])):
            vals = ", ".join(f"{lay.get(k)} at {d}" for d, lay in zip(depths, layouts))
            return f"the gradient buckets do not grow like the model ({k}: {vals} blocks; bucket_mb)"
    return None


def window_check(cfg, rank: int, world: int, depths: tuple[int, ...], cache: dict) -> str | None:
    """Why the buckets are not affine over ``depths`` (a window, then the planned depth; None: they are, or the
    run has none). ``cache``: layouts by depth over the caller's windows."""
    n = depths[-1]
    if n not in cache:
        cache[n] = bucket_layout(cfg, rank, world)
    if cache[n] is None:
        return None
    from memopt.planner.extrapolate import at_depth

    for d in depths[:-1]:
        if d not in cache:
            cache[d] = bucket_layout(at_depth(cfg, d), rank, world)
    return bucket_inconsistency([cache[d] for d in depths], depths)


WING = Wing(window_check=window_check, micro_batches_repeat=True, model_bound=lambda cfg: True)

"""Hybrid Adam's placement decided before step 0, from a plan (issue #29, deliverable 3).

Why: PatrickStar moves optimizer chunks to the device only after its warm-up step, so that step's host
peak holds every rank's fp32 master, momentum and variance, and the host bounds the model size while
the devices keep room unused. The planner runs the engine's own warm-up on fake tensors (the same
per-moment non-model peaks the run's tracer measures), so its engines already decided how many groups
the margin holds; ``strategy.hybrid_adam.device_groups`` set to that count makes the run (and the
re-plan) create those groups on the device at build. The run's warm-up then checks the decision and
warns with the bytes when its measured margin holds fewer (engines/chunk/engine.py).

Applied where a plan exists before the ranks start: plan mode (``trainer.mode=plan``) and the
preflight of a ``python -m memopt.train`` run that plans (not under an external torchrun, and not
when the preflight finds the run trivially small: then the warm-up decides, as before).
"""
from __future__ import annotations

import copy


def places_groups(cfg) -> bool:
    """A Hybrid Adam run whose placement is not set: its plan decides it (``plan_placed``)."""
    hybrid = getattr(cfg.strategy, "hybrid_adam", None)
    return hybrid is not None and hybrid.device_groups is None


def planned_device_groups(cfg, plan: dict | None) -> tuple[int, int] | None:
    """(the optimizer groups the plan's warm-up put on the device, the most its measured moments allow
    there), on every planned rank (the least of each); None when the run is no Hybrid Adam run, its
    placement is set already, or the plan has none."""
    if not places_groups(cfg) or not plan:
        return None
    counts = list((plan.get("optim_groups_on_device") or {}).values())
    most = list((plan.get("optim_groups_device_max") or {}).values())
    if not counts or any(c is None for c in counts):
        return None
    n = min(counts)
    return n, max(n, min(most)) if most and all(m is not None for m in most) else n


def plan_placed(cfg, hw, limits: dict | None = None) -> dict:
    """``make_plan`` of ``cfg``; for a Hybrid Adam run whose placement is not set, the plan of the run with
    optimizer groups made on the device at build (``placement`` in the plan says how many, what the
    warm-up chose, the most the device allows and the node's host had they been placed after the
    warm-up). The count: the warm-up's own (PatrickStar's margin: every parameter chunk kept on the
    device; when that is none and the run fits so, the run is left to its warm-up: forcing groups onto
    the device then only makes parameter chunks move every step, 5x the step of gpt_1b's chunk row on
    an H100), or, when that plan does not fit, the most the warm-up's moments allow (the device budget
    less the fullest moment with every chunk it does not compute with evicted: parameter chunks then
    move between host and device each step so that the host holds fewer optimizer bytes). When that many
    leave the device too little room (the plan's device peak over the device: a moment's transients
    beyond what its warm-up recorded), the groups the overflow takes go back to the host and the run is
    planned again, down to the warm-up's count.

    The first plan (the probe, ``probe_config``) runs without ``limits`` and without the engine's host
    check: the warm-up must run to decide, and the run may fit only once the groups are placed (a model
    whose states alone exceed the host RAM may fit with groups on the devices)."""
    from memopt.errors import ConfigError
    from memopt.memory.tracker import HOST
    from memopt.planner.plan import make_plan
    from memopt.planner.simulate import PlanOverflow

    if not places_groups(cfg):
        return make_plan(cfg, hw, limits)
    first = make_plan(probe_config(cfg), hw)
    decided = planned_device_groups(cfg, first)
    if decided is None or decided == (0, 0):
        if limits is not None and not first["fits"]:
            return make_plan(cfg, hw, limits)
        host_check(cfg)  # the probe skipped it: the engine refuses the run as typed here, as at its build
        return first
    n, most = decided
    if n == 0 and first["fits"]:  # the warm-up's own count fits: no group is forced onto the device
        try:
            host_check(cfg)
            return first
        except ConfigError:  # the engine's host share refuses it as typed: the groups must go to the device
            pass
    if n and n != most:  # the warm-up's own count first: PatrickStar's margin, no parameter chunk moves for it
        try:
            placed = make_plan(with_device_groups(cfg, n), hw, limits)
            if placed["fits"]:
                return _noted(placed, n, n, most, first)
        except PlanOverflow:
            pass
    group = 12 * _chunk_size(cfg)  # one optimizer group: fp32 master, momentum, variance of a chunk
    k = most
    while True:
        try:
            placed = make_plan(with_device_groups(cfg, k), hw, limits)
        except PlanOverflow as e:
            if e.device == HOST or e.reason is not None or k <= n:
                raise
            k = max(n, k - max(1, -(-(e.total - e.limit) // group)))
            continue
        dev = placed["fit"].get("device")
        if placed["fits"] or dev is None or dev["fits"] or k <= n:
            return _noted(placed, k, n, most, first)
        # the groups leave the device's transients too little room (a moment's bytes beyond the ones its
        # warm-up recorded): the groups the overflow takes go back to the host, and the run is planned again
        k = max(n, k - max(1, -(-(-dev["margin"]) // group)))


def _noted(placed: dict, k: int, n: int, most: int, first: dict) -> dict:
    placed["placement"] = {"device_groups": k, "warmup_groups": n, "device_max": most,
                           "node_host_bytes_warmup_placed": first["node_host_bytes"]}
    return placed


def _chunk_size(cfg) -> int:
    """The chunk size the engine chooses for ``cfg`` (its layout on rank 0, nothing allocated)."""
    from memopt.parallel.dims import expected_world
    from memopt.planner.engines.chunk.depth import layouts

    return layouts(cfg, [0], expected_world(cfg))[0]["chunk_size"]


def host_check(cfg) -> None:
    """The chunk engine's build-time host check (``check_host_budget``, a ``ConfigError``) on the planned ranks."""
    from memopt.parallel.dims import expected_world
    from memopt.planner.engines.chunk.depth import layout
    from memopt.planner.plan import simulated_ranks

    world = expected_world(cfg)
    for r in simulated_ranks(world):
        layout(cfg, r, world)


def probe_config(cfg):
    """The configuration the placement is probed with: ``device_groups=0`` (none made on the device at
    build; the warm-up still places PatrickStar's count and measures the most the device allows) and
    the engine's build-time host check out of the way (a host of 2**40 GiB in ``cfg.hardware``, which
    only that check reads; the plan's fit is judged on ``hw``): the placed plan is checked, the probe
    only measures."""
    out = with_device_groups(cfg, 0)
    out.hardware.host_memory_gb = float(2**40)
    return out


def with_device_groups(cfg, n: int):
    """A copy of the typed config with ``strategy.hybrid_adam.device_groups = n``."""
    out = copy.deepcopy(cfg)
    out.strategy.hybrid_adam.device_groups = n
    return out

"""The chunk engine at depth: its plan replayed from a recorded shallow step, or, where it is
extrapolated like any engine (``planner/extrapolate.py``), its discrete decisions checked.

A large chunk in groups of W ranks changes a rank's layout only every W chunks, which no shallow window
follows; its chunk size is searched over the whole model; Hybrid Adam's placement and the eviction are
decisions, not slopes. So the wing (``Wing``'s depth hooks) gives the core: the planned model's chunk
size pinned and its layout packed first (``prepare``: the engine's host-budget refusal names the planned
model's bytes), the replay at depth N (``replayed``), the layout's affinity over a window
(``window_check``) and the decisions' (``sample_check``), and each rank's layout (``layouts``: the node's
host is the sum of its ranks', which differ).
"""
from __future__ import annotations

from dataclasses import replace

from memopt.planner.extrapolate import at_depth, lerp

REPLAY_DEPTH = 5  # blocks of the recorded step: blocks 2 and 3 are the two middle ones compared


def replayed(cfg, rank: int, world: int, limits, backend: str, n: int | None, verify: bool) -> dict:
    """The chunk engine at depth N from an n-block recording (``replay.py``; n: ``REPLAY_DEPTH`` when None); with
    ``verify``, the recording stretched to n + 1 blocks must equal the recording of n + 1 blocks item for item (every
    byte the model side allocates and frees, in order, every call into the engine, the FLOPs and the
    traffic), else ``Unsupported`` says so."""
    import time

    from memopt.planner.engines.chunk import replay as chunk_replay

    t0 = time.perf_counter()
    n = n or REPLAY_DEPTH
    N = cfg.model.n_layer
    # with expert parallelism a rank's experts carry its own global names: a recording per rank then
    key = (model_side(at_depth(cfg, n)), world, backend, rank if cfg.parallel.ep > 1 else None)
    mine = _RECORDED.get(key)  # the model side is every rank's (comm.py: same calls, same order) and every candidate's
    if mine is not None and verify and not mine[2]:  # that differs only in the chunk engine's options (model_side)
        mine = None
    try:
        if mine is None:
            streams, _ = chunk_replay.record(at_depth(cfg, n), rank, world, backend)
            if verify:
                deeper, _ = chunk_replay.record(at_depth(cfg, n + 1), rank, world, backend)
                if chunk_replay.stretch(streams, n, n + 1) != chunk_replay.stretch(deeper, n + 1, n + 1):
                    raise chunk_replay.Unsupported(f"the {n}-block recording stretched to {n + 1} blocks differs from the "
                                                   f"{n + 1}-block recording")
            mine = (streams, rank, verify)
            if len(_RECORDED) >= 4:
                _RECORDED.pop(next(iter(_RECORDED)))
            _RECORDED[key] = mine
        stretched = _STRETCHED.get((key, N))
        if stretched is None or stretched[0] is not mine[0]:  # the next rank replays the same stretch
            _STRETCHED.clear()
            stretched = _STRETCHED[(key, N)] = (mine[0], chunk_replay.stretch(mine[0], n, N))
        sim = chunk_replay.replay(cfg, stretched[1], rank, world, limits, backend)
    except chunk_replay.Unsupported as e:
        e.seconds = time.perf_counter() - t0
        raise
    src = f"rank {mine[1]}'s recorded n_layer={n} step" if mine[1] != rank else f"a recorded n_layer={n} step"
    return {**sim, "seconds": time.perf_counter() - t0, "window": None, "replay": n,
            "method": f"replayed at n_layer={N} from {src}" + (f" (checked at {n + 1})" if verify else "")}


_RECORDED: dict = {}  # the last recordings (streams, rank, checked): the next rank and later candidates replay them
_STRETCHED: dict = {}  # the last recording stretched to the planned depth (items are tuples: replays only read them)


def model_side(cfg) -> str:
    """What a recording (``chunk_replay.record``) depends on: the configuration without the chunk engine's
    own options (``strategy.chunk``, ``hybrid_adam``, ``static_partition``: chunk size, budgets,
    communication, optimizer placement), the hardware (the engine's budgets; the collectives' backend
    is keyed apart) and ``trainer.save_checkpoint`` (the engine's state dict after the step, not
    recorded). The recorded items name tensors and modules, never chunks, and the 5-vs-6-block check
    compares recordings of two different layouts; tests/planner/test_chunk_replay.py records the same
    model under different engine options and compares the recordings. So the preflight's candidates
    that differ only there (chunk options, budgets) replay one recording."""
    s = cfg.strategy
    neutral = {f: None for f in ("chunk", "hybrid_adam", "static_partition") if hasattr(s, f)}
    return repr(replace(cfg, strategy=replace(s, **neutral), hardware=None, logger=None,
                        trainer=replace(cfg.trainer, save_checkpoint=None)))


def _pin_chunk_size(cfg, rank: int, world: int):
    """The chunk engine searches its chunk size over the whole model: the shallow ones take the planned one's."""
    if cfg.strategy.chunk.chunk_size:
        return cfg
    from memopt.strategies.base import selected

    from memopt.engines.chunk.engine import grad_reuse
    from memopt.strategies.precision import Precision

    # the choice reads the parameters' sizes (the model and its model-phase strategies: moe adds experts),
    # the world and ep, the payload and gradient bytes and the device budget (engines/chunk/defaults.py)
    key = (repr(cfg.model), repr([(st.name, opts) for st, opts in selected(cfg, "model")]), world, repr(cfg.strategy.chunk),
           cfg.hardware.device_memory_gb, Precision.of(cfg).name, grad_reuse(cfg), cfg.parallel.ep)  # ep: the expert list's ranks
    if key not in _CHUNK_SIZE:  # the same search on every rank and every candidate of that model: once
        _CHUNK_SIZE.clear()
        _CHUNK_SIZE[key] = layout(cfg, rank, world)["chunk_size"]
    size = _CHUNK_SIZE[key]
    return replace(cfg, strategy=replace(cfg.strategy, chunk=replace(cfg.strategy.chunk, chunk_size=size)))


_CHUNK_SIZE: dict = {}


def layout(cfg, rank: int, world: int) -> dict:
    """This rank's chunk layout (``chunk_layout``). The meta model's parameter sizes it packs are the same on
    every rank (its model-phase strategies do not depend on the rank; with expert parallelism each rank's
    experts have other names, the same shapes): listed once per depth, model, world and ep, not once per rank,
    window and candidate (a suggestion search packs ~100 layouts at ~15 depths; a 50-block model takes
    ~0.2 s to build)."""
    import torch

    from memopt.compose import model_on_meta
    from memopt.engines.chunk.engine import chunk_layout, distinct_params
    from memopt.memory.tracker import NullTracker
    from memopt.planner.simulate import fake_world
    from memopt.strategies.base import selected

    key = (repr(cfg.model), repr([(st.name, opts) for st, opts in selected(cfg, "model")]), world, cfg.parallel.ep)
    with fake_world(cfg, rank, world) as dims:
        params = _META_PARAMS.get(key)
        if params is None:
            params = distinct_params(model_on_meta(cfg, torch.device("cpu"), dims, NullTracker()))
            if len(_META_PARAMS) >= 64:
                _META_PARAMS.pop(next(iter(_META_PARAMS)))
            _META_PARAMS[key] = params
        return chunk_layout(cfg, None, dims, params)


def layouts(cfg, ranks, world: int) -> dict[int, dict]:
    """``layout`` of each of ``ranks`` with the engine's build-time host check out of the way (a host of
    2**40 GiB in a copy of ``cfg.hardware``, which only that check reads): the layout alone, for callers
    whose plan judges the host itself (the node's per-rank sum, the placement's group size)."""
    import copy

    probe = copy.deepcopy(cfg)
    probe.hardware.host_memory_gb = float(2**40)
    return {r: layout(probe, r, world) for r in ranks}


_META_PARAMS: dict = {}  # distinct_params of the meta models layout packed (~0.1 MB each), by model, strategies and world


def _layout_inconsistency(lays: list[dict], rank: int, depths: tuple[int, ...]) -> str | None:
    """Why this rank's chunk layout is not affine over ``depths`` (the window, then the planned depth)."""
    d0, d1 = depths[:2]
    for k in ("chunks", "local", "local_padding", "optim_groups"):
        if any(lerp(lays[0][k], lays[1][k], d0, d1, d) != lay[k] for d, lay in zip(depths[2:], lays[2:])):
            vals = ", ".join(f"{lay[k]} at {d}" for d, lay in zip(depths, lays))
            return f"rank {rank}'s chunk layout is not affine in depth ({k}: {vals} blocks)"
    return None


def _decision_inconsistency(cfg, a: dict, b: dict, n1: int, n2: int, groups_n: int) -> str | None:
    """Why the chunk engine's eviction or Hybrid Adam placement at depth N would not follow the samples."""
    from memopt.engines.chunk.hybrid_adam import groups_that_fit

    n = cfg.model.n_layer
    ma, mb = a["engine_metrics"], b["engine_metrics"]
    if (ma.get("evictions", 0) > 0) != (mb.get("evictions", 0) > 0):
        return "chunks are evicted at one sampled depth only"
    nonmodel = lerp(ma.get("max_nonmodel_bytes", 0), mb.get("max_nonmodel_bytes", 0), n1, n2, n)
    dev_chunks = lerp(a["peaks"].get("device", {}).get("chunks", 0), b["peaks"].get("device", {}).get("chunks", 0), n1, n2, n)
    if not ma.get("evictions") and ma.get("device_budget_bytes") and dev_chunks + nonmodel > ma["device_budget_bytes"]:
        return "the deeper model's chunks would be evicted, the sampled ones are not"
    hybrid = cfg.strategy.hybrid_adam
    if hybrid is not None and ma.get("placement_margin_bytes") is not None:
        groups = lerp(ma["optim_chunks_on_device"], mb["optim_chunks_on_device"], n1, n2, n)
        margin = lerp(ma["placement_margin_bytes"], mb["placement_margin_bytes"], n1, n2, n)
        rule = groups_that_fit(int(margin), 12 * cfg.strategy.chunk.chunk_size, groups_n,
                               cfg.strategy.chunk.margin_use_ratio, hybrid.max_device_chunks)
        if groups != rule:
            return f"Hybrid Adam would place {rule} optimizer groups on the device, the samples extrapolate to {groups:g}"
    return None




def prepare(cfg, rank: int, world: int):
    """``cfg`` with the planned model's chunk size pinned (the shallow samples take it), its layout packed
    first: the engine's host-budget refusal then names the planned model's bytes, not a shallow recording's
    (which would refuse too, quoting 1/7 of them)."""
    base = _pin_chunk_size(cfg, rank, world)
    layout(base, rank, world)
    return base


def window_check(cfg, rank: int, world: int, depths: tuple[int, ...], cache: dict) -> str | None:
    """Why this rank's chunk layout is not affine over ``depths`` (a window, then the planned depth; None:
    it is). ``cache``: layouts by depth, kept by the caller over its windows."""
    for d in depths:
        if d not in cache:
            cache[d] = layout(at_depth(cfg, d), rank, world)
    return _layout_inconsistency([cache[d] for d in depths], rank, depths)


def sample_check(cfg, a: dict, b: dict, n1: int, n2: int, cache: dict) -> str | None:
    """Why the engine's eviction or Hybrid Adam placement at the planned depth would not follow the samples
    at ``n1``, ``n2`` (None: they follow); ``cache``: ``window_check``'s layouts."""
    return _decision_inconsistency(cfg, a, b, n1, n2, cache[cfg.model.n_layer]["optim_groups"])

"""Deep models planned from shallow ones: the blocks are identical, so the peaks are affine in depth.

A fake step costs ~0.3-0.5 ms per op whatever the tensor sizes, so a full plan of gpt_10b (50 blocks,
two ranks, two steps) takes a minute or more. Every block adds the same parameters, gradients,
optimizer states, checkpoint boundaries and FLOPs, so once the peak moment has settled each rank's
peak per memory and category, its traffic and its FLOPs are affine in the number of blocks n:
``p(N) = p(n2) + (p(n3) - p(n2)) (N - n2) / (n3 - n2)``. ``simulate`` runs the run's own code
(``simulate_rank``) at three depths n1 < n2 < n3, checks that (n1, n2) and (n2, n3) extrapolate to
the same plan at the configured depth N (0.1%), and uses (n2, n3); a window that fails the checks
is passed over for the next one, and when none passes before sampling would cost the full depth, the
rank is simulated block by block. Everything else of the configuration is the run's.

Where it is not exact, and what is done about it:
  * The first blocks: the peak moment moves while the model is shallow (without checkpointing, until
    ~4 blocks: measured), hence n1 >= MIN_DEPTH and the three-depth check.
  * Depth-dependent defaults are pinned to the planned model's values: ``strategy.ckpt.k`` (every_k:
    round(sqrt(n_layer))) and the chunk engine's searched ``chunk_size``.
  * Periodic structure: checkpoint segments of k blocks and MoE layers every k blocks repeat with
    period k, so every sampled depth is N (mod period).
  * The chunk engine's discrete decisions are checked, not assumed: this rank's chunk layout (chunks,
    its own real and padding chunks, its optimizer groups: the manager's own packing code on meta
    parameters, ``chunk_layout``) must be affine over the window and N, Hybrid Adam's placement (the
    engine's rule ``groups_that_fit`` applied to the extrapolated margin must give the extrapolated
    number of device groups) and eviction (none at either depth and none needed at N, or some at
    both). A large chunk (gpt_10b: 3.7 blocks) in groups of W ranks changes a rank's layout only every
    W chunks, which no shallow window follows. Hence the chunk engine (period 1: no every_k segments,
    no MoE) is not extrapolated first but *replayed* (``planner/engines/chunk/replay.py``): a recorded 5-block step's
    model side, stretched to N blocks, drives the real engine built at depth N, so the layout and the
    engine's decisions are the planned model's own, not extrapolated (exact by construction; the
    first rank checks the stretch against a 6-block recording). Where the replay does not apply (the
    reason is kept), the windows above are tried, then the block-by-block simulation.
  * ZeRO-1/2 size buckets and flat-group padding round per bucket / group (a few elements). The
    buckets' packing (their number, the two largest) must be affine over the window and N, else a
    shallow model held in one bucket extrapolates a bucket as large as the deep model (``planner/engines/memopt.py``).
Small models (n1 + n2 + n3 > N / 2) and ``trainer.plan_exact=true`` are simulated block by block.
"""
from __future__ import annotations

import math
from dataclasses import replace

MIN_DEPTH = 3  # from 3 blocks on, the slope is the deep model's (the first and last blocks differ; measured)


def period(cfg) -> int:
    """Blocks after which the model's structure repeats (checkpoint segments, MoE layers)."""
    p = 1
    s, n = cfg.strategy, cfg.model.n_layer
    ckpt = getattr(s, "ckpt", None)
    if ckpt is not None and ckpt.policy == "every_k":
        from memopt.strategies.ckpt import resolve_k

        p = math.lcm(p, resolve_k(ckpt, n))
    moe = getattr(s, "moe", None)
    if moe is not None:
        p = math.lcm(p, moe.every_k_layers)
    pipe = getattr(s, "pipeline", None)
    if pipe is not None:  # every stage gains a block at once (an even split); a given split: exact only
        from memopt.engines.pipeline.schedules import stages_of

        from memopt.strategies.pipeline import given_split

        p = math.lcm(p, n if given_split(pipe) is not None else stages_of(cfg))
    return p


def sample_depths(cfg) -> list[tuple[int, int, int]]:
    """Candidate windows (n1, n2, n3) of sampled depths, cheapest first: n1 >= MIN_DEPTH, all = N (mod
    period), n1 + n2 + n3 <= N / 2 (else the full depth is about as cheap); none with
    ``trainer.plan_exact=true``."""
    if getattr(cfg.trainer, "plan_exact", False):
        return []
    n, p = cfg.model.n_layer, period(cfg)
    n1 = max(MIN_DEPTH, p)
    n1 += (n - n1) % p
    depths = range(n1, n, p)
    wins = [(a, b, c) for a in depths for b in depths if b > a for c in depths if c > b and a + b + c <= n // 2]
    return sorted(wins, key=lambda w: (sum(w), w))


def at_depth(cfg, n: int):
    """``cfg`` with ``n`` blocks, depth-dependent defaults pinned to the planned model's values."""
    s = cfg.strategy
    ckpt = getattr(s, "ckpt", None)
    if ckpt is not None and ckpt.policy == "every_k" and ckpt.k is None:
        from memopt.strategies.ckpt import resolve_k

        s = replace(s, ckpt=replace(ckpt, k=resolve_k(ckpt, cfg.model.n_layer)))
    return replace(cfg, model=replace(cfg.model, n_layer=n), strategy=s)


def lerp(a: float, b: float, n1: int, n2: int, n: int) -> float:
    return a + (b - a) * (n - n1) / (n2 - n1)


def _nested(a: dict, b: dict, n1: int, n2: int, n: int) -> dict:
    out = {}
    for k in [*a, *(k for k in b if k not in a)]:  # the simulation's order (device before host)
        x, y = a.get(k, 0), b.get(k, 0)
        if isinstance(x, dict) or isinstance(y, dict):
            out[k] = _nested(x or {}, y or {}, n1, n2, n)
        else:
            out[k] = max(0, round(lerp(x, y, n1, n2, n)))
    return out


def _moments(a: dict, b: dict, n1: int, n2: int, n: int) -> dict:
    """The compute bytes a step records at its moments (``simulate_rank``: at the backward's start, at
    each early gradient's arrival, in each early recomputation; DeepSpeed's rules read them), at depth n:
    each grows by the blocks' activations, so by the same line. A list holds an entry per gradient or
    recomputation in the backward's order, the same number per block: its first entries (the blocks
    both depths have, the last ones first) are extrapolated; those of the root group after them are
    left out, as is a list whose length does not grow by whole blocks (the rules then take the step's
    compute peak instead)."""
    out = {k: _nested(a.get(k) or {}, b.get(k) or {}, n1, n2, n) for k in ("backward_nonmodel", "backward_with_grads")}
    out["data"] = max(0, round(lerp(a.get("data", 0), b.get("data", 0), n1, n2, n)))
    for key in ("grad_ready_nonmodel", "recompute_nonmodel"):
        x, y = a.get(key) or [], b.get(key) or []
        per, rest = divmod(len(y) - len(x), n2 - n1)  # entries per block
        if x and not rest and per >= 0:
            k = min(len(x), per * n1) if per else len(x)
            out[key] = [max(0, round(lerp(u, v, n1, n2, n))) for u, v in zip(x[:k], y[:k])]
    return out


def simulate(cfg, rank: int, world: int, limits: dict | None = None, backend: str = "gloo",
             windows: list[tuple[int, int, int]] | None = None, verify: bool = True, replay: int | None = None) -> dict:
    """``simulate_rank``'s result for ``cfg``: exact for small models, else extrapolated from the last
    two depths of the first window (``sample_depths``, or ``windows``) that passes the checks: the
    first two depths extrapolate to the same plan as the last two (within 0.1%; ``verify=False`` skips
    this, for a rank after one that passed it), the chunk layout is affine over the window and the
    planned depth, the chunk engine's decisions follow. The chunk engine is first planned by replaying
    a recorded shallow step at depth N (``engines/chunk/replay.py``; ``replay``: the recorded depth, else
    ``REPLAY_DEPTH`` when the model is deep enough to sample). ``method`` says which, and why the exact
    simulation was taken when extrapolation was tried; ``window`` is the window used."""
    from memopt.planner.engines import wing
    from memopt.planner.engines.memopt import bucket_inconsistency
    from memopt.planner.simulate import simulate_rank

    n = cfg.model.n_layer
    wins = windows or sample_depths(cfg)
    w = wing(cfg)
    chunk = w.chunks
    if not wins and replay is None:
        return {**simulate_rank(cfg, rank, world, limits, backend=backend), "method": "exact"}
    base = _pin_chunk_size(cfg, rank, world) if chunk else cfg
    if chunk:  # the planned model packed first: the engine's host-budget refusal names its bytes, not a
        _layout(base, rank, world)  # shallow recording's (which would refuse too, quoting 1/7 of them)
    why = "no sampled depths"
    seconds, replay_why = 0.0, None
    if chunk and windows is None and (replay is not None or period(cfg) == 1):
        from memopt.planner.engines.chunk.replay import Unsupported

        try:
            return _replayed(base, rank, world, limits, backend, replay or REPLAY_DEPTH, verify)
        except Unsupported as e:
            replay_why, seconds = f"not replayed: {e}", getattr(e, "seconds", 0.0)
        if not wins:
            sim = simulate_rank(cfg, rank, world, limits, backend=backend)
            return {**sim, "seconds": sim["seconds"] + seconds, "method": f"exact ({replay_why})"}
    layouts: dict[int, dict] = {}
    sims: dict[int, dict] = {}
    bucket_layout = w.bucket_layout or (lambda cfg, rank, world: None)
    buckets = {n: bucket_layout(cfg, rank, world)}  # size buckets (ddp, zero1/2): their packing must follow too
    for a, b, c in wins:
        if buckets[n] is not None:
            buckets.update({d: bucket_layout(at_depth(cfg, d), rank, world) for d in (a, b, c) if d not in buckets})
            why = bucket_inconsistency([buckets[d] for d in (a, b, c, n)], (a, b, c, n))
            if why is not None:
                continue
        if chunk:
            for d in (a, b, c, n):
                if d not in layouts:
                    layouts[d] = _layout(at_depth(base, d), rank, world)
            why = _layout_inconsistency([layouts[d] for d in (a, b, c, n)], rank, (a, b, c, n))
            if why is not None:
                continue
        need = [d for d in ((a, b, c) if verify else (b, c)) if d not in sims]
        if windows is None and sum(sims) + sum(need) > n:  # sampling would cost more than the full depth
            why = why if sims else "sampling costs more than the full depth"
            break
        for d in need:
            sims[d] = simulate_rank(at_depth(base, d), rank, world, None, backend=backend)
        if verify:
            why = _disagreement(sims[a], sims[b], sims[c], (a, b, c), n)
            if why is not None:
                continue
        if chunk:
            why = _decision_inconsistency(base, sims[b], sims[c], b, c, layouts[n]["optim_groups"])
            if why is not None:
                continue
        sa, sb = sims[b], sims[c]
        peaks = _nested(sa["peaks"], sb["peaks"], b, c, n)
        out = {"rank": rank, "peaks": peaks, "traffic": _nested(sa["traffic"], sb["traffic"], b, c, n),
               "flops": round(lerp(sa["flops"], sb["flops"], b, c, n)),
               "comm_per_step": _nested(sa.get("comm_per_step") or {}, sb.get("comm_per_step") or {}, b, c, n),
               "seconds": sum(x["seconds"] for x in sims.values()),
               "engine_metrics": {}, "window": (a, b, c),
               "method": f"extrapolated from n_layer={b},{c}" + (f" (checked at {a})" if verify else ""),
               **_moments(sa, sb, b, c, n)}
        _check_limits(peaks, limits)
        return out
    sim = simulate_rank(cfg, rank, world, limits, backend=backend)
    why = why if replay_why is None else f"{replay_why}; {why}"
    return {**sim, "seconds": sim["seconds"] + seconds + sum(x["seconds"] for x in sims.values()), "method": f"exact ({why})"}


REPLAY_DEPTH = 5  # blocks of the recorded step: blocks 2 and 3 are the two middle ones compared


def _replayed(cfg, rank: int, world: int, limits, backend: str, n: int, verify: bool) -> dict:
    """The chunk engine at depth N from an n-block recording (``planner/engines/chunk/replay.py``); with ``verify``, the
    recording stretched to n + 1 blocks must equal the recording of n + 1 blocks item for item (every
    byte the model side allocates and frees, in order, every call into the engine, the FLOPs and the
    traffic), else ``Unsupported`` says so."""
    import time

    from memopt.planner.engines.chunk import replay as chunk_replay

    t0 = time.perf_counter()
    N = cfg.model.n_layer
    key = (model_side(at_depth(cfg, n)), world, backend)
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


REL, FLOOR = 1e-3, 4096


def _disagreement(sa: dict, sb: dict, sc: dict, depths: tuple[int, int, int], n: int) -> str | None:
    """Why (n1, n2) and (n2, n3) extrapolate to different plans at depth n (None: they agree)."""
    a, b, c = depths

    def flat(sim: dict) -> dict:
        out = {"flops": sim["flops"], **{f"traffic {k}": v for k, v in sim["traffic"].items()}}
        out.update({f"{m} {cat}": v for m, cats in sim["peaks"].items() for cat, v in cats.items()})
        return out

    fa, fb, fc = flat(sa), flat(sb), flat(sc)
    for k in {*fa, *fb, *fc}:
        x, y, z = fa.get(k, 0), fb.get(k, 0), fc.get(k, 0)
        lo, hi = lerp(x, y, a, b, n), lerp(y, z, b, c, n)
        if abs(lo - hi) > max(REL * abs(hi), FLOOR):
            return f"{k} is not yet affine at n_layer={a},{b},{c}"
    return None


def _pin_chunk_size(cfg, rank: int, world: int):
    """The chunk engine searches its chunk size over the whole model: the shallow ones take the planned one's."""
    if cfg.strategy.chunk.chunk_size:
        return cfg
    from memopt.strategies.base import selected

    from memopt.engines.chunk.engine import grad_reuse
    from memopt.strategies.precision import Precision

    # the choice reads the parameters' sizes (the model and its model-phase strategies: moe adds experts),
    # the world, the payload and gradient bytes and the device budget (engines/chunk/defaults.py)
    key = (repr(cfg.model), repr([(st.name, opts) for st, opts in selected(cfg, "model")]), world, repr(cfg.strategy.chunk),
           cfg.hardware.device_memory_gb, Precision.of(cfg).name, grad_reuse(cfg))
    if key not in _CHUNK_SIZE:  # the same search on every rank and every candidate of that model: once
        _CHUNK_SIZE.clear()
        _CHUNK_SIZE[key] = _layout(cfg, rank, world)["chunk_size"]
    size = _CHUNK_SIZE[key]
    return replace(cfg, strategy=replace(cfg.strategy, chunk=replace(cfg.strategy.chunk, chunk_size=size)))


_CHUNK_SIZE: dict = {}


def _layout(cfg, rank: int, world: int) -> dict:
    """This rank's chunk layout (``chunk_layout``). The meta model's parameters it packs are the same on
    every rank (the chunk engine partitions over dp_shard only; its model-phase strategies do not depend
    on the rank): listed once per depth, model and world, not once per rank, window and candidate (a
    suggestion search packs ~100 layouts at ~15 depths; a 50-block model takes ~0.2 s to build)."""
    import torch

    from memopt.compose import model_on_meta
    from memopt.engines.chunk.engine import chunk_layout, distinct_params
    from memopt.memory.tracker import NullTracker
    from memopt.planner.simulate import fake_world
    from memopt.strategies.base import selected

    key = (repr(cfg.model), repr([(st.name, opts) for st, opts in selected(cfg, "model")]), world)
    with fake_world(cfg, rank, world) as dims:
        params = _META_PARAMS.get(key)
        if params is None:
            params = distinct_params(model_on_meta(cfg, torch.device("cpu"), dims, NullTracker()))
            if len(_META_PARAMS) >= 64:
                _META_PARAMS.pop(next(iter(_META_PARAMS)))
            _META_PARAMS[key] = params
        return chunk_layout(cfg, None, dims, params)


def layouts(cfg, ranks, world: int) -> dict[int, dict]:
    """``_layout`` of each of ``ranks`` with the engine's build-time host check out of the way (a host of
    2**40 GiB in a copy of ``cfg.hardware``, which only that check reads): the layout alone, for callers
    whose plan judges the host itself (the node's per-rank sum, the placement's group size)."""
    import copy

    probe = copy.deepcopy(cfg)
    probe.hardware.host_memory_gb = float(2**40)
    return {r: _layout(probe, r, world) for r in ranks}


_META_PARAMS: dict = {}  # distinct_params of the meta models _layout packed (~0.1 MB each), by model, strategies and world


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


def _check_limits(peaks: dict, limits: dict | None) -> None:
    """The preflight's limits, judged on the extrapolated peaks (the exact path stops at the first op over)."""
    from memopt.planner.simulate import PlanOverflow

    for mem, limit in (limits or {}).items():
        if limit is None:
            continue
        cats = peaks.get(mem, {}) if mem != "all" else {
            c: sum(p.get(c, 0) for p in peaks.values()) for c in {c for p in peaks.values() for c in p}}
        live = {c: v for c, v in cats.items() if c != "total"}
        total = cats.get("total", 0)
        if total > limit:
            raise PlanOverflow(mem, live, limit)

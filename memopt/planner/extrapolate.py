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
  * The chunk engine's discrete decisions are checked, not assumed (its wing: ``planner/engines/chunk/
    depth.py``): this rank's chunk layout (chunks,
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


def lerp_nested(a: dict, b: dict, n1: int, n2: int, n: int) -> dict:
    out = {}
    for k in [*a, *(k for k in b if k not in a)]:  # the simulation's order (device before host)
        x, y = a.get(k, 0), b.get(k, 0)
        if isinstance(x, dict) or isinstance(y, dict):
            out[k] = lerp_nested(x or {}, y or {}, n1, n2, n)
        else:
            out[k] = max(0, round(lerp(x, y, n1, n2, n)))
    return out


def _moments(a: dict, b: dict, n1: int, n2: int, n: int, layout: tuple[int, int, int] | None = None) -> dict:
    """The compute bytes a step records at its moments (``simulate_rank``: at the backward's start, at
    each early gradient's arrival, in each early recomputation, at each parameter's first gradient with its
    index; DeepSpeed's rules read them), at depth n:
    each grows by the blocks' activations, so by the same line. A list holds an entry per gradient or
    recomputation in the backward's order, the same number per block: its first entries (the blocks
    both depths have, the last ones first) are extrapolated; those of the root group after them are
    left out, as is a list whose length does not grow by whole blocks (the rules then take the step's
    compute peak instead). ``grad_arrivals`` is rebuilt whole where the model's ``layout`` is known
    (``_whole_arrivals``)."""
    out = {k: lerp_nested(a.get(k) or {}, b.get(k) or {}, n1, n2, n) for k in ("backward_nonmodel", "backward_with_grads")}
    out["data"] = max(0, round(lerp(a.get("data", 0), b.get("data", 0), n1, n2, n)))
    for key in ("grad_ready_nonmodel", "recompute_nonmodel", "grad_arrivals"):
        x, y = a.get(key) or [], b.get(key) or []
        if key == "grad_arrivals" and layout is not None:
            whole = _whole_arrivals(x, y, n1, n2, n, *layout)
            if whole is not None:
                out[key] = whole
                continue
        per, rest = divmod(len(y) - len(x), n2 - n1)  # entries per block
        if x and not rest and per >= 0:
            k = min(len(x), per * n1) if per else len(x)
            out[key] = [_lerp_entry(u, v, n1, n2, n) for u, v in zip(x[:k], y[:k])]
    return out


def block_layout(cfg) -> tuple[int, int, int] | None:
    """(parameters before the first block, parameters per block, the structure's period) of the model built on
    meta, in ``model.parameters()``'s order (the arrivals' indices); None unless the blocks' parameters are
    contiguous and of one count."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    from memopt.models import model_class

    with _disable_current_modes(), torch.device("meta"):
        model = model_class(cfg.model)(cfg.model)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    blocks = [[index[id(p)] for p in b.parameters()] for b in model.blocks]
    q = len(blocks[0]) if blocks else 0
    if not q or any(b != list(range(blocks[0][0] + j * q, blocks[0][0] + (j + 1) * q)) for j, b in enumerate(blocks)):
        return None
    return blocks[0][0], q, period(cfg)


def _whole_arrivals(x: list, y: list, n1: int, n2: int, n: int, s: int, q: int, p: int) -> list | None:
    """Each parameter's first gradient at depth n ([index, compute bytes then, their peak until the next]) from
    depths n1 < n2, every block's: the roots before the blocks (the head's), the blocks from the last, each in
    the same order, the roots after (the embeddings'). The last n1 - 1 blocks' entries are lerped by their place
    from the last block and the first n1 - 1's by their place from the first (a block's moments hold the
    activations of the blocks below it, its own and the head's fixed; the shallower depth's block at the other end
    is left out: the embeddings' or the head's backward follows it there); a block between takes the line of its
    phase (``period``) between the nearest of each. None where the lists are not of that shape (the rules then
    take the step's compute peak)."""
    def split(arr: list, d: int):
        head, blocks, tail = [], [[] for _ in range(d)], []
        for i, at, until in arr:
            if s <= i < s + d * q:
                if tail:
                    return None
                blocks[(i - s) // q].append(((i - s) % q, at, until))
            else:
                (tail if any(blocks) else head).append((i if i < s else i + (n - d) * q, at, until))
        body = [i for i, _, _ in arr[len(head):len(arr) - len(tail)]]  # from the last block, each in one order
        if body != [s + j * q + o for j in reversed(range(d)) for o, _, _ in blocks[0]]:
            return None
        return head, blocks, tail

    sx, sy = split(x, n1), split(y, n2)
    m = n1 - 1  # the shallower depth's blocks not next to its other end (the embeddings' backward, the head's)
    if sx is None or sy is None or p > m:
        return None
    (hx, bx, tx), (hy, by, ty) = sx, sy
    if [e[0] for e in hx] != [e[0] for e in hy] or [e[0] for e in tx] != [e[0] for e in ty] or \
            [e[0] for e in bx[0]] != [e[0] for e in by[0]]:
        return None

    def lerped(u: list, v: list) -> list:
        return [[i, *(_lerp_entry(a, b, n1, n2, n) for a, b in zip(us, vs))] for (i, *us), (_, *vs) in zip(u, v)]

    blocks: list = [None] * n
    for j in range(m):
        blocks[j] = lerped(bx[j], by[j])  # the first blocks, by their place from the first
    for j in range(m):
        blocks[n - 1 - j] = lerped(bx[n1 - 1 - j], by[n2 - 1 - j])  # the last, by their place from the last
    for j in range(m, n - m):
        lo = m - p + (j - m) % p  # the nearest of its phase among the first, and among the last
        hi = n - m + (j - (n - m)) % p
        blocks[j] = [[o, *(round(a + (b - a) * (j - lo) / (hi - lo)) for a, b in zip(us, vs))]
                     for (o, *us), (_, *vs) in zip(blocks[lo], blocks[hi])]
    body = [[s + j * q + o, at, until] for j in reversed(range(n)) for o, at, until in blocks[j]]
    return [*lerped(hx, hy), *body, *lerped(tx, ty)]


def _lerp_entry(u, v, n1: int, n2: int, n: int):
    """A moment's entry at depth n: a number, or a list of them (``grad_arrivals``: a parameter's index in
    the model, which moves by a block's parameters per block, and its compute bytes), each on its line."""
    if isinstance(u, list):
        return [_lerp_entry(p, q, n1, n2, n) for p, q in zip(u, v)]
    return max(0, round(lerp(u, v, n1, n2, n)))


def simulate(cfg, rank: int, world: int, limits: dict | None = None, backend: str = "gloo",
             windows: list[tuple[int, int, int]] | None = None, verify: bool = True, replay: int | None = None) -> dict:
    """``simulate_rank``'s result for ``cfg``: exact for small models, else extrapolated from the last
    two depths of the first window (``sample_depths``, or ``windows``) that passes the checks: the
    first two depths extrapolate to the same plan as the last two (within 0.1%; ``verify=False`` skips
    this, for a rank after one that passed it), and the engine's wing agrees (``Wing.window_check``: its
    structure, the memopt engine's buckets or the chunk layout, is affine over the window and the planned
    depth; ``Wing.sample_check``: its decisions follow). An engine whose wing replays (the chunk engine:
    ``engines/chunk/depth.py``) is first planned by replaying a recorded shallow step at depth N
    (``replay``: the recorded depth, else the wing's own). ``method`` says which, and why the exact
    simulation was taken when extrapolation was tried; ``window`` is the window used."""
    from memopt.planner.engines import wing
    from memopt.planner.engines.base import NotReplayed
    from memopt.planner.simulate import simulate_rank

    n = cfg.model.n_layer
    wins = windows or sample_depths(cfg)
    w = wing(cfg)
    if not wins and replay is None:
        return {**simulate_rank(cfg, rank, world, limits, backend=backend), "method": "exact"}
    base = w.prepare(cfg, rank, world) if w.prepare else cfg  # the engine's searched sizes pinned to the planned model's
    why = "no sampled depths"
    seconds, replay_why = 0.0, None
    if w.replay and windows is None and (replay is not None or period(cfg) == 1):
        try:
            return w.replay(base, rank, world, limits, backend, replay, verify)
        except NotReplayed as e:
            replay_why, seconds = f"not replayed: {e}", e.seconds
        if not wins:
            sim = simulate_rank(cfg, rank, world, limits, backend=backend)
            return {**sim, "seconds": sim["seconds"] + seconds, "method": f"exact ({replay_why})"}
    cache: dict = {}  # the wing's checks' answers by depth (layouts), over the windows
    sims: dict[int, dict] = {}
    for a, b, c in wins:
        if w.window_check:  # the engine's own structure must grow like the model (buckets, chunk layout)
            off = w.window_check(base, rank, world, (a, b, c, n), cache)
            if off is not None:
                why = off
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
        if w.sample_check:  # the engine's decisions (eviction, placement) must follow the samples
            why = w.sample_check(base, sims[b], sims[c], b, c, cache)
            if why is not None:
                continue
        sa, sb = sims[b], sims[c]
        peaks = lerp_nested(sa["peaks"], sb["peaks"], b, c, n)
        out = {"rank": rank, "peaks": peaks, "traffic": lerp_nested(sa["traffic"], sb["traffic"], b, c, n),
               "flops": round(lerp(sa["flops"], sb["flops"], b, c, n)),
               "comm_per_step": lerp_nested(sa.get("comm_per_step") or {}, sb.get("comm_per_step") or {}, b, c, n),
               "seconds": sum(x["seconds"] for x in sims.values()),
               "engine_metrics": {}, "window": (a, b, c),
               "method": f"extrapolated from n_layer={b},{c}" + (f" (checked at {a})" if verify else ""),
               **_moments(sa, sb, b, c, n, block_layout(base))}
        _check_limits(peaks, limits)
        return out
    sim = simulate_rank(cfg, rank, world, limits, backend=backend)
    why = why if replay_why is None else f"{replay_why}; {why}"
    return {**sim, "seconds": sim["seconds"] + seconds + sum(x["seconds"] for x in sims.values()), "method": f"exact ({why})"}


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


def _check_limits(peaks: dict, limits: dict | None) -> None:
    """The preflight's limits, judged on the extrapolated peaks (the exact path stops at the first op over)."""
    from memopt.planner.simulate import ACTIVATIONS, PlanOverflow

    for mem, limit in (limits or {}).items():
        if limit is None:
            continue
        if mem == ACTIVATIONS:
            got = peaks.get("device", {}).get("activations", 0)
            if got > limit:
                raise PlanOverflow("device", {"activations": got}, limit)
            continue
        cats = peaks.get(mem, {}) if mem != "all" else {
            c: sum(p.get(c, 0) for p in peaks.values()) for c in {c for p in peaks.values() for c in p}}
        live = {c: v for c, v in cats.items() if c != "total"}
        total = cats.get("total", 0)
        if total > limit:
            raise PlanOverflow(mem, live, limit)

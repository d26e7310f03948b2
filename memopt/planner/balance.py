"""``strategy.pipeline.split=balanced``: the blocks per stage whose largest planned stage peak is the least.

Why the planner and not a count of blocks: a stage's peak is not its share of the blocks. Under 1F1B
stage s keeps pp - s micro-batches of activations, so a block on the first stage weighs up to pp times
one on the last (GPipe: every stage keeps all m); the first stage also holds the embeddings, the last
the final norm, its copy of the tied output layer, the logits and the loss; the optimizer step and the
receive buffers add their own. The planner runs each stage's rank on fake tensors (``simulate_rank``)
and sees all of it, so the balance is judged on planned peaks.

Search: the even split (blocks spread as evenly as they go, the extra ones on the last stages) is
planned; with at least two blocks per stage a second split (one block fewer on every stage but the
last) gives each stage's peak as an affine function of its blocks, and the split that minimises the
largest of those estimates (blocks added one at a time where the estimate stays least) is planned too.
From the best of them, one block at a time moves from the stage with the largest planned peak to the
one with the least while the largest planned peak falls (any vector of counts is a split: stages are
consecutive ranges). The answer is the best planned split seen, so its largest planned peak is never
above the even split's. Each planned split costs one fake step per stage (about a second each for a
small model). Built for one stage per rank (gpipe, 1f1b; ``Pipeline.validate`` refuses the rest).

It is resolved before any rank starts (``resolve_split``: the gate, ``memopt.gate``, and ``memopt.api``), which writes
the list into the run's config, so every rank builds the same stages and config.yaml records them.
"""
from __future__ import annotations

import dataclasses
import sys


def even_split(n_layer: int, stages: int) -> list[int]:
    """Blocks as evenly as they go, the extra ones on the last stages (the first holds the most micro-batches)."""
    q, r = divmod(n_layer, stages)
    return [q + (1 if s >= stages - r else 0) for s in range(stages)]


def stage_peaks(cfg, split: list[int], backend: str = "gloo") -> list[int]:
    """The planned peak (every memory's total) of each stage's rank (stage s on rank s x world / pp, the
    first data-parallel rank of that stage) with ``split``."""
    from memopt.parallel.dims import expected_world, resolve_sizes
    from memopt.planner.simulate import simulate_rank

    world = expected_world(cfg)
    pp = resolve_sizes(cfg.parallel, world)["pp"]
    pipe = dataclasses.replace(cfg.strategy.pipeline, split=list(split))
    planned = dataclasses.replace(cfg, strategy=dataclasses.replace(cfg.strategy, pipeline=pipe))
    out = []
    for s in range(pp):
        peaks = simulate_rank(planned, s * (world // pp), world, backend=backend)["peaks"]
        out.append(sum(v.get("total", 0) for v in peaks.values()))
    return out


def _affine_best(a: list[int], pa: list[int], b: list[int], pb: list[int], n: int) -> list[int]:
    """The split minimising the largest estimated peak, each stage's peak taken affine in its blocks
    through (a, pa) and (b, pb): blocks added one at a time to the stage whose estimate after it is least
    (optimal for increasing costs: the bottleneck allocation)."""
    slope = [max(1.0, (y - x) / (j - i)) for i, j, x, y in zip(a, b, pa, pb)]  # a flat or falling slope: rounding
    base = [x - k * i for i, x, k in zip(a, pa, slope)]
    split = [1] * len(a)
    for _ in range(n - len(a)):
        s = min(range(len(a)), key=lambda t: base[t] + slope[t] * (split[t] + 1))
        split[s] += 1
    return split


def balanced_split(cfg, backend: str = "gloo") -> dict:
    """{"split": the blocks per stage, "peaks": its planned stage peaks, "even": the even split, "even_peaks":
    its planned stage peaks, "planned": how many splits were planned}."""
    from memopt.parallel.dims import expected_world, resolve_sizes

    n = cfg.model.n_layer
    k = resolve_sizes(cfg.parallel, expected_world(cfg))["pp"]
    seen: dict[tuple, list[int]] = {}

    def plan(split: list[int]) -> list[int]:
        key = tuple(split)
        if key not in seen:
            seen[key] = stage_peaks(cfg, split, backend)
        return seen[key]

    even = even_split(n, k)
    starts = [even]
    if n >= 2 * k:
        other = [b - 1 for b in even[:-1]] + [even[-1] + k - 1]
        starts.append(other)
        starts.append(_affine_best(even, plan(even), other, plan(other), n))
    best = min(starts, key=lambda sp: max(plan(sp)))
    for _ in range(n):  # each move lowers the largest planned peak, so this ends; n bounds it
        peaks = plan(best)
        hi = max(range(k), key=peaks.__getitem__)
        lo = min(range(k), key=peaks.__getitem__)
        if hi == lo or best[hi] <= 1:
            break
        moved = list(best)
        moved[hi] -= 1
        moved[lo] += 1
        if max(plan(moved)) >= max(peaks):
            break
        best = moved
    return {"split": best, "peaks": plan(best), "even": even, "even_peaks": plan(even), "planned": len(seen)}


def resolve_split(cfg, typed, backend: str | None = None) -> dict | None:
    """``strategy.pipeline.split=balanced`` replaced, in the DictConfig ``cfg`` and the typed config, by the
    planner's split (printed with the planned peaks); the search's record, or None when there is nothing to
    balance. ``backend``: the planned run's collectives (default: nccl with a GPU, else gloo)."""
    pipe = getattr(typed.strategy, "pipeline", None)
    if pipe is None or pipe.split != "balanced":
        return None
    if backend is None:
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    got = balanced_split(typed, backend)
    typed.strategy.pipeline.split = list(got["split"])
    cfg.strategy.pipeline.split = list(got["split"])
    mib = lambda xs: "[" + ", ".join(f"{x / 2**20:.1f}" for x in xs) + "] MiB"  # noqa: E731
    print(f"memopt: strategy.pipeline.split=balanced -> {got['split']} (planned stage peaks {mib(got['peaks'])}; "
          f"even {got['even']}: {mib(got['even_peaks'])}; {got['planned']} splits planned)", file=sys.stderr)
    return got

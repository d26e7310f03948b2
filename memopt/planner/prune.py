"""Fewer plans for the same winner: a composition's smaller micro-batches are skipped once a larger one fits.

``+strategy=auto`` tries each composition at several micro-batch sizes, the accumulation keeping the global
batch. For one composition a smaller micro-batch runs the same FLOPs over more micro-batches: the same
compute and memory-bound bytes, more ops, as many or more collectives and copies; its predicted step is
never shorter, and its peak never higher. So the search plans a composition's sizes from the largest down
and stops at the first that fits: the ones below it cannot win (a tie keeps the larger, which the ranking
lists first anyway). Two kinds are planned at every size, because there a smaller micro-batch can be faster:
a pipeline (more micro-batches shrink the bubble) and the chunk engine (smaller activations leave the device
room for more optimizer groups, whose Adam then runs on the device).

And a candidate that cannot be faster than the fastest fitting step found so far (with ``strategy.auto.trials=k``,
the k-th fastest: every one it trials is planned) is not planned, by either of two lower bounds of its step. Its
model's own forward and backward (``model_work.py``: one micro-batch of the composed model alone, times the
accumulation, whose step time every engine that runs that model adds to). And
its compute term: candidates that do the same math (``work_class``: checkpointing, parallel sizes and their
options; not the precision, the ZeRO stage, offload or chunk placement, which change rates and bytes, not FLOPs)
count the same FLOPs, so once one of them is planned the others are bounded at their own dtype's rates (a
pipeline's, whose model side is a stage's). The search plans the likely fastest first (the dtype of the highest
peak, no recomputation), so that fp32 and fp16 candidates under a fast bf16 winner are bounded by the bf16
plans' FLOPs without a plan of their own. A candidate being planned stops too: once one of its simulated ranks
steps slower than the step to beat (``plan.SlowerThan``: the plan's step is its slowest rank's), and a composition
whose largest micro-batch goes over while its engine is built is over at its smaller ones (``plan_chain``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

SKIPPED = "not planned: a larger micro-batch of this composition fits, and a smaller one is never predicted faster"


# A class's members plan FLOPs within 1.3% of each other (the chunk engine's few counted ops of its own: every
# class of gpt_tiny's and moe_tiny's exhaustive 2-rank searches, 2026-11-27): the bound is taken 3% under.
MARGIN = 0.97


def work_class(cfg) -> tuple:
    """What a candidate's FLOPs depend on (its typed config): checkpointing (its recomputation), the parallel
    sizes and tensor parallelism's and the pipeline's options, and under a pipeline the micro-batches (its
    bubble). Not the precision: candidates of one class run the same FLOPs, each at its dtype's rates."""
    s = cfg.strategy
    pipeline = getattr(s, "pipeline", None)
    return (repr(getattr(s, "ckpt", None)), repr(cfg.parallel), repr(getattr(s, "tp", None)), repr(pipeline),
            (cfg.trainer.micro_batch_size, cfg.trainer.grad_accum) if pipeline is not None else None)


def bounded(chain: Sequence[int], bound: Callable[[int, float], float | None], best_s: float | None) -> int:
    """How many of ``chain``'s first candidates to plan: the chain stops at the first whose step's lower bound
    (``bound(i, best_s)``: seconds, None where none is known yet; it may stop looking once over ``best_s``) is
    slower than ``best_s``; the smaller micro-batches after it are never faster (above)."""
    if best_s is None:
        return len(chain)
    for k, i in enumerate(chain):
        b = bound(i, best_s)
        if b is not None and b > best_s:
            return k
    return len(chain)


def skipped_row(item, kind: str, why: str) -> dict:
    """The row of a candidate not planned: ``kind`` "micro-batch" or "bound" (the two rules above)."""
    return {"overrides": item.overrides(), "candidate": item, "fits": False, "skipped": kind, "why": why}


BOUNDS = "its model's own work, or its compute as planned on a candidate of the same math"


def bound_row(item, bound_s: float, best_s: float, what: str = BOUNDS) -> dict:
    row = skipped_row(item, "bound", f"not planned: its step takes at least {bound_s:.3g} s ({what}), more than a "
                                     f"fitting candidate's whole step ({best_s:.3g} s)")
    return {**row, "bound_s": bound_s}


def chains(keys: Sequence, micro_batches: Sequence[int], every_size: Sequence[bool]) -> list[list[int]]:
    """Candidate indices in planning chains: candidates with the same ``keys[i]`` (the composition without
    its micro-batch and accumulation) in one chain, largest micro-batch first; ``every_size[i]``: a
    candidate planned on its own (pipeline, chunk engine)."""
    groups: dict = {}
    out: list[list[int]] = []
    for i, key in enumerate(keys):
        if every_size[i]:
            out.append([i])
        else:
            groups.setdefault(key, []).append(i)
    out += [sorted(g, key=lambda i: -micro_batches[i]) for g in groups.values()]
    return sorted(out, key=lambda c: min(c))


def _micro_batch(row: dict) -> str:
    return next((o for o in row["overrides"] if o.startswith("trainer.micro_batch_size=")), "a larger micro-batch")


def plan_chain(chain: Sequence, plan: Callable[..., dict], *args) -> list[dict]:
    """``plan(item, *args)`` for each candidate of ``chain`` in order until one fits; the rest get a row saying
    why they were skipped (``fits`` False, ``skipped`` True, their ``candidate`` and ``overrides``). Or until one
    is bounded (its first rank slower than the step to beat: the smaller micro-batches take its bound), or goes
    over while its engine is built (``at_build``: its model states, before any micro-batch): the rest go over
    there too, and say so (``fits`` False). The build reads no micro-batch size; where the accumulation adds
    states (DeepSpeed's stage 2 keeps a gradient partition between micro-batches) a smaller micro-batch holds
    more, never fewer. (An overflow found on a deep model's extrapolated samples is not marked so: those are planned
    whole.) Module level, picklable data in and out: a worker process plans a whole chain."""
    rows: list[dict] = []
    for item in chain:
        if any(r["fits"] for r in rows):
            rows.append(skipped_row(item, "micro-batch", SKIPPED))
        elif rows and rows[-1].get("skipped") == "bound":  # a smaller micro-batch is never faster
            src = next(r for r in rows if r.get("skipped") == "bound")
            rows.append({**skipped_row(item, "bound", f"{src['why']} (at {_micro_batch(src)} of its composition: a "
                                                      "smaller one is never faster)"), "bound_s": src["bound_s"]})
        elif rows and rows[-1].get("at_build"):
            src = next(r for r in rows if r.get("at_build"))  # the one planned
            rows.append({"overrides": item.overrides(), "candidate": item, "fits": False, "at_build": True,
                         "why": f"{src['why']} (as at {_micro_batch(src)}: its states, built before any micro-batch)"})
        else:
            rows.append(plan(item, *args))
    return rows

"""Pipeline candidates for ``+strategy=auto`` and the preflight's suggestion: which ``parallel.pp`` sizes
and schedules a run can take, checked before any plan is made so that the search plans only
compositions the pipeline strategy accepts.

Why a module of its own: the rules are the pipeline strategy's (``memopt/strategies/pipeline.py``),
read here without composing a config per candidate; the search and the preflight both use them. Each
candidate is then planned like any other: the planner runs the pipeline engine on fake tensors as the
first and the last stage, so the per-stage peaks (1F1B's pp - s micro-batches in flight, GPipe's m)
and the bubble in the step time judge the fit and the rank.

Batch: the ranks of one pipeline share its micro-batches (one pipeline sees the batch once), so a
candidate with pp stages accumulates pp times more micro-batches than data parallelism over the same
ranks: the global batch stays the command's, and the micro-batches, ``trainer.grad_accum``, are at
least pp, which 1F1B needs.
"""
from __future__ import annotations

from memopt.planner.candidate import Candidate
from memopt.strategies.pipeline import MULTI, micro_batch_rule

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")  # zero_bubble: its bubble is not planned (an upper bound only)


def pp_sizes(cfg, world: int) -> list[int]:
    """``parallel.pp`` values > 1 dividing the world and the GPT's blocks (the even split); none where
    the pipeline strategy refuses the run whatever the size: another engine, another architecture,
    MoE, frozen parameters."""
    m = cfg.model
    if not _engine_runs_pipeline(cfg) or m.arch != "gpt" or m.freeze or getattr(cfg.strategy, "moe", None) is not None:
        return []
    return [p for p in range(2, world + 1) if world % p == 0 and m.n_layer % p == 0]


def _engine_runs_pipeline(cfg) -> bool:
    """Whether ``engine=`` implements the pipeline strategy (its ``SUPPORTS``; the memopt engine, which has
    none, implements them all and builds the pipeline engine for it)."""
    import importlib

    from memopt.engines import ENGINES

    supports = getattr(importlib.import_module(ENGINES[cfg.engine.name]), "SUPPORTS", None)
    return supports is None or "pipeline" in supports


def schedules_for(n_layer: int, pp: int, m: int, names=SCHEDULES) -> list[str]:
    """The schedules of ``names`` that ``m`` micro-batches over ``pp`` ranks can run with an even split
    (interleaved: 2 virtual stages per rank, so the blocks divide by 2 pp)."""
    return [s for s in names if micro_batch_rule(s, m, pp) is None and n_layer % (pp * (2 if s in MULTI else 1)) == 0]


def pp_candidates(cfg, precisions: list[str], mbs: list[int], global_mb: int, world: int, ckpt: dict,
                  precision: dict) -> list[Candidate]:
    """The pipeline candidates of ``+strategy=auto``: pp size x schedule x micro-batch x checkpointing x
    precision, ddp over the data-parallel ranks each stage has left (``ckpt`` and ``precision``: the search's
    tables of strategy names and options)."""
    a = cfg.strategy.auto
    if not a.pp:
        return []
    out = []
    for pp in pp_sizes(cfg, world):
        dp = world // pp
        for mb in mbs:
            accum = max(1, global_mb * pp // mb)  # the pipeline's ranks share the micro-batches
            for sched in schedules_for(cfg.model.n_layer, pp, accum, a.pp_schedule):
                for ck in a.ckpt:
                    ck_s, ck_o = ckpt[ck]
                    for p in precisions:
                        names = (*precision[p], *ck_s, "pipeline", *(["ddp"] if dp > 1 else []))
                        out.append(Candidate(names, (*ck_o, ("trainer.micro_batch_size", mb), ("trainer.grad_accum", accum),
                                                     ("parallel.pp", pp), ("strategy.pipeline.schedule", sched))))
    return out


def pp_compositions(cfg, world: int) -> list[Candidate]:
    """The preflight's pipeline suggestions: 1F1B (the fewest micro-batches in flight) at each pp size from
    the smallest (the least bubble), without and with checkpointing; the accumulation scaled by pp / the
    command's pp keeps its global batch (skipped where that is no integer)."""
    accum, own = cfg.trainer.grad_accum, max(1, cfg.parallel.pp)
    out = []
    for pp in pp_sizes(cfg, world):
        m, rest = divmod(accum * pp, own)
        if rest or not schedules_for(cfg.model.n_layer, pp, m, ("1f1b",)):
            continue
        opts = (("parallel.pp", pp), ("trainer.grad_accum", m))
        out += [Candidate(("pipeline",), opts), Candidate(("pipeline", "ckpt"), opts)]
    return out

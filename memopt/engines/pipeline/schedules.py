"""The schedules ``strategy.pipeline.schedule`` names, and what each implies from its shape alone:
micro-batches in flight per stage, the bubble, the bytes crossing stage boundaries. The formulas are
the papers' and are what tests and ``experiments/pipeline`` compare the measured run against.

    gpipe              every forward, then every backward: each stage holds all m micro-batches'
                       activations at its peak (Huang et al. 2019)
    1f1b               after pp - s warm-up forwards, stage s alternates one forward and one backward:
                       it holds min(m, pp - s) micro-batches (PipeDream-Flush, Narayanan et al. 2019)
    interleaved_1f1b   v stages per rank, looped: the bubble shrinks by v (Narayanan et al. 2021)
    zero_bubble        torch's interleaved zero-bubble schedule: backward split into the input and the
                       weight gradients, the latter filling the bubble (Qi et al. 2023)
"""
from __future__ import annotations


def schedule_class(name: str):
    """The ``torch.distributed.pipelining`` schedule for ``name`` (single-stage or multi-stage)."""
    from torch.distributed import pipelining as P

    return {"gpipe": P.ScheduleGPipe, "1f1b": P.Schedule1F1B, "interleaved_1f1b": P.ScheduleInterleaved1F1B,
            "zero_bubble": P.ScheduleInterleavedZeroBubble}[name]


def in_flight(schedule: str, stage: int, pp: int, m: int) -> int | None:
    """Micro-batches whose activations stage ``stage`` (of ``pp``, one per rank) holds at its peak
    with ``m`` micro-batches; None for the interleaved schedules (their warm-up depends on the rounds)."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, pp - stage)
    return None


def bubble_fraction(pp: int, m: int, virtual: int = 1) -> float:
    """The idle share of a step of a fill-drain pipeline with equal stages, ignoring communication:
    (pp - 1) / (v m + pp - 1), GPipe and 1F1B alike (v = 1); interleaving v stages per rank divides the
    bubble's length by v (Narayanan et al. 2021). Zero-bubble schedules aim at 0 and are not covered."""
    return (pp - 1) / (virtual * m + pp - 1)


def boundary_bytes(pp: int, virtual: int, m: int, batch: int, seq: int, d_model: int, nbytes: int) -> int:
    """Bytes one step sends between stages, over all ranks of one pipeline: each of the pp x v - 1
    boundaries carries every micro-batch's (batch, seq, d_model) activation forward and its gradient back."""
    return (pp * virtual - 1) * m * 2 * batch * seq * d_model * nbytes


def stages_of(cfg) -> int:
    """Stages of a ``+strategy=pipeline`` run: parallel.pp x virtual stages."""
    from memopt.parallel.dims import expected_world, resolve_sizes
    from memopt.strategies.pipeline import virtual_stages

    return resolve_sizes(cfg.parallel, expected_world(cfg))["pp"] * virtual_stages(cfg.strategy.pipeline)


def planned_bubble(cfg) -> float | None:
    """The bubble fraction the planner puts in a step's compute time (None without a pipeline). The
    zero-bubble schedule is given the interleaved schedule's bubble: an upper bound, its own depends
    on how the weight gradients fill the gaps."""
    opts = getattr(cfg.strategy, "pipeline", None)
    if opts is None:
        return None
    from memopt.strategies.pipeline import virtual_stages

    v = virtual_stages(opts)
    return bubble_fraction(stages_of(cfg) // v, cfg.trainer.grad_accum, v)

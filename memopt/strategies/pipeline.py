"""``+strategy=pipeline``: pipeline (model) parallelism over ``parallel.pp`` ranks (GPipe, Huang et al.
2019; 1F1B, Narayanan et al. 2019 (PipeDream-Flush); interleaved 1F1B, Narayanan et al. 2021; zero
bubble, Qi et al. 2023), run by ``torch.distributed.pipelining``'s stages and schedules.

The model's blocks are split into ``parallel.pp x virtual_stages`` consecutive stages (evenly unless
``split`` gives the blocks of each, or is ``balanced``: the planner's split, whose largest planned stage
peak is the least); the first stage also holds the embeddings, the last the final
norm, the output layer and the loss. Stage k lives on pipeline rank ``k mod pp`` (torch's looped
placement). The micro-batches of a step are ``trainer.grad_accum``'s: the schedule runs all of them
in one call. The engine that runs it is ``memopt/engines/pipeline``; this module holds the options and
the rules checked before anything is allocated.

What it composes with is what that engine implements (``SUPPORTS`` there): ddp over the data-parallel
ranks of each stage, activation checkpointing, fp16 / bf16. The strategies that own the partitioning
or the step in another way are excluded here, the rest refused by the engine's support check.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memopt.errors import ConfigError
from memopt.parallel.dims import expected_world, resolve_sizes
from memopt.strategies.base import Strategy, register

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MULTI = ("interleaved_1f1b", "zero_bubble")  # schedules with several (virtual) stages per rank


@dataclass
class PipelineConfig:
    """``+strategy=pipeline``: how the blocks are split into stages and in which order micro-batches run."""

    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble (torch's interleaved zero bubble)
    virtual_stages: int | None = None  # stages per rank; None: 1 (gpipe, 1f1b) or 2 (interleaved_1f1b, zero_bubble)
    # blocks of each stage, in order (pp x virtual_stages entries), or even (None: the same), or balanced:
    # the planner's split whose largest planned stage peak is the least (memopt/planner/balance.py; resolved
    # to a list before the ranks start). Any: OmegaConf has no union of a list and a string.
    split: Any = None


def virtual_stages(c: PipelineConfig) -> int:
    return c.virtual_stages if c.virtual_stages is not None else (2 if c.schedule in MULTI else 1)


SPLITS = ("even", "balanced")


def given_split(c: PipelineConfig) -> list[int] | None:
    """``split`` when it lists the blocks of each stage; None for even (or None) and balanced."""
    if c.split is None or isinstance(c.split, str):
        return None
    if any(isinstance(b, bool) or not isinstance(b, int) for b in c.split):
        raise ConfigError(f"strategy.pipeline.split={list(c.split)} must list whole block counts (e.g. [1,3]), or be "
                          f"{' or '.join(SPLITS)}")
    return list(c.split)


def stage_blocks(c: PipelineConfig, n_layer: int, pp: int) -> list[int]:
    """The number of blocks of each stage, in stage order (validated by ``Pipeline.validate``)."""
    if c.split == "balanced":  # a run resolves it before its ranks start (train.run, memopt.api)
        raise ConfigError("strategy.pipeline.split=balanced reached an engine unresolved: the planner chooses the "
                          "blocks per stage before any rank starts (memopt.planner.balance.resolve_split)")
    n = pp * virtual_stages(c)
    given = given_split(c)
    return given if given is not None else [n_layer // n] * n


def micro_batch_rule(schedule: str, m: int, pp: int) -> str | None:
    """Why ``m`` micro-batches cannot run ``schedule`` on ``pp`` ranks, with the values that would; None if they can."""
    if schedule == "1f1b" and m < pp:
        return (f"trainer.grad_accum={m} micro-batches are fewer than the parallel.pp={pp} stages: 1F1B keeps every "
                f"stage busy with one micro-batch in flight per later stage; use trainer.grad_accum>={pp} "
                "(or strategy.pipeline.schedule=gpipe)")
    if schedule in MULTI:
        rounds = max(1, m // pp)
        if m % rounds:
            ok = [k for k in range(pp, 4 * pp + 1) if k % max(1, k // pp) == 0]
            return (f"trainer.grad_accum={m} micro-batches: strategy.pipeline.schedule={schedule} runs them in rounds "
                    f"of parallel.pp={pp} and needs a multiple of the {rounds} rounds; use trainer.grad_accum in {ok}")
    return None


@register
class Pipeline(Strategy):
    name, Config, phase, order, engine = "pipeline", PipelineConfig, "partition", -2, "pipeline"
    uses = ("pp",)
    excludes = ("zero1", "zero2", "zero3", "chunk", "static_partition", "hybrid_adam", "cpu_offload", "tp", "moe")
    excludes_why = ("the pipeline engine partitions the model by blocks over parallel.pp and all-reduces each stage's "
                    "gradients over its data-parallel ranks (ddp); ZeRO stages, the chunk engine, the host optimizer "
                    "step, tensor parallelism and MoE experts inside a stage are not built; +strategy=[pipeline,ddp] "
                    "(or ckpt, fp16, bf16) composes")

    def validate(self, c: PipelineConfig, cfg) -> None:
        p, m = "strategy.pipeline", cfg.model
        if c.schedule not in SCHEDULES:
            raise ConfigError(f"{p}.schedule={c.schedule!r} is not one of: {', '.join(SCHEDULES)}")
        if cfg.engine.name not in ("memopt", "deepspeed"):
            raise ConfigError(f"+strategy=pipeline with engine={cfg.engine.name} is not built: its stages run in "
                              "memopt's pipeline engine or DeepSpeed's (engines/deepspeed_pipe.py); use engine=memopt "
                              "or engine=deepspeed")
        if m.arch != "gpt":
            raise ConfigError(f"model.arch={m.arch!r} with +strategy=pipeline: stages are built for model.arch=gpt "
                              "(its embeddings, blocks, final norm and head); use model.arch=gpt")
        if m.freeze:
            raise ConfigError(f"model.freeze={list(m.freeze)} with +strategy=pipeline is not built: a tied output "
                              "layer is a copy on the last stage under another name, which the globs would not "
                              "freeze with its embedding; use model.freeze=[] (or a run without pipeline)")
        pp = resolve_sizes(cfg.parallel, expected_world(cfg))["pp"]
        if pp < 2:
            raise ConfigError(f"+strategy=pipeline with parallel.pp={pp} splits nothing: set parallel.pp>=2 (the "
                              "stages; e.g. parallel.pp=2 trainer.nproc_per_node=2), or drop +strategy=pipeline")
        v = virtual_stages(c)
        if c.schedule in MULTI and v < 2:
            raise ConfigError(f"{p}.virtual_stages={v} with {p}.schedule={c.schedule}: interleaved schedules place "
                              f"several stages on each rank; use {p}.virtual_stages>=2 (or schedule=1f1b)")
        if c.schedule not in MULTI and v != 1:
            raise ConfigError(f"{p}.virtual_stages={v} with {p}.schedule={c.schedule}: one stage per rank; use "
                              f"{p}.schedule=interleaved_1f1b for virtual stages, or {p}.virtual_stages=1")
        n = pp * v
        if isinstance(c.split, str) and c.split not in SPLITS:
            raise ConfigError(f"{p}.split={c.split!r} is not one of: {', '.join(SPLITS)}, or a list of the blocks of "
                              f"each of the {n} stages")
        if c.split == "balanced":
            if c.schedule in MULTI:
                raise ConfigError(f"{p}.split=balanced with {p}.schedule={c.schedule} is not built: the balance is "
                                  f"planned for one stage per rank; use {p}.schedule=1f1b or gpipe, or {p}.split=even "
                                  f"(or a list of the blocks of each of the {n} stages)")
            if m.n_layer < n:
                raise ConfigError(f"{p}.split=balanced: model.n_layer={m.n_layer} blocks are fewer than the "
                                  f"parallel.pp={pp} stages; use parallel.pp<={m.n_layer}")
        elif given_split(c) is None:
            if m.n_layer % n:
                ok = [d for d in range(2, m.n_layer + 1) if m.n_layer % (d * v) == 0]
                raise ConfigError(
                    f"model.n_layer={m.n_layer} blocks do not split evenly into parallel.pp={pp} x "
                    f"{p}.virtual_stages={v} = {n} stages; use parallel.pp in {ok or 'none (fewer virtual stages)'}, "
                    f"or give {p}.split (the blocks of each of the {n} stages, or balanced)")
        else:
            split = given_split(c)
            if len(split) != n or any(b < 1 for b in split) or sum(split) != m.n_layer:
                raise ConfigError(f"{p}.split={split} must list {n} stages (parallel.pp={pp} x virtual_stages={v}) "
                                  f"of at least one block each, summing to model.n_layer={m.n_layer}")
        why = micro_batch_rule(c.schedule, cfg.trainer.grad_accum, pp)
        if why:
            raise ConfigError(why)

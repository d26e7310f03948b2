"""``+strategy=auto``: the planner picks the composition (``memopt.planner.search``).

Not a memory strategy itself: before any rank starts, ``python -m memopt.train`` replaces it by the
fastest predicted composition that fits the ``hardware`` profile, searched over precision x
checkpointing x ZeRO stage x optimizer offload x chunk engine budget x micro-batch (gradient
accumulation keeps the global batch), and with ``+strategy=[auto,moe]`` (or an MoE model preset) the
expert-parallel size ``parallel.ep``, without MoE on several ranks tensor parallelism and pipeline
parallelism (``parallel.pp`` x schedule); it prints the
ranked candidates and runs the winner. An engine never sees it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from memopt.errors import ConfigError
from memopt.strategies.base import Strategy, register


@dataclass
class AutoConfig:
    """``+strategy=auto``: the search space (each list is one axis)."""

    # fp32 | bf16 | fp16 | half: the profile's faster 16-bit dtype (planner/search.half_dtype); CPU-only: fp32 kept
    precision: list[str] = field(default_factory=lambda: ["fp32", "half"])
    ckpt: list[str] = field(default_factory=lambda: ["none", "full"])  # none | full | every_k | selective
    stage: list[str] = field(default_factory=lambda: ["ddp", "zero2", "zero3"])  # ddp | zero1 | zero2 | zero3 (several ranks)
    offload: list[bool] = field(default_factory=lambda: [False, True])  # cpu_offload
    chunk_budget_gb: list[float] = field(default_factory=lambda: [0.0])  # hybrid_adam device budgets; 0: whole device
    micro_batch_size: list[int] = field(default_factory=list)  # empty: trainer.micro_batch_size, halved up to 2 times
    ep: list[int] = field(default_factory=list)  # with +strategy=moe: expert-parallel sizes; empty: every valid one
    tp: bool = True  # several ranks, no MoE: also tensor parallelism (parallel.tp, sequence_parallel, loss_parallel)
    pp: bool = True  # several ranks, no MoE: also pipeline parallelism (parallel.pp x pp_schedule, planner/search_pp.py)
    pp_schedule: list[str] = field(default_factory=lambda: ["1f1b", "gpipe", "interleaved_1f1b"])  # pipeline schedules searched
    top: int = 10  # ranked candidates printed
    # the k fastest predicted candidates that fit train trial_steps steps each; the first of them by plan and trial
    # (trial_weight) runs (planner/trials.py: the step-time model cannot order candidates within ~10%). 0: the plan's
    # first runs
    trials: int = 0
    trial_steps: int = 3
    # the trials that ran are ordered by planned^(1-w) x measured^w: both estimate the step, each with an error of
    # tens of percent on a shared machine (planner/trials.py). 1: the fastest measured; 0: the plan's order
    trial_weight: float = 0.5


@register
class Auto(Strategy):
    name, Config, phase = "auto", AutoConfig, "offload"

    def validate(self, opts, cfg) -> None:
        others = [n for n in cfg.strategy.selected() if n not in ("auto", "moe")]  # moe: the model, searched over ep
        if others:
            raise ConfigError(f"+strategy=auto chooses the whole composition; drop {', '.join(others)} (or drop auto); "
                              f"only moe (which changes the model) may be selected with it")
        t = cfg.trainer
        batch = t.micro_batch_size * t.grad_accum
        bad = [m for m in opts.micro_batch_size if m < 1 or batch % m]
        if bad:
            ok = [m for m in range(1, batch + 1) if batch % m == 0]
            raise ConfigError(f"strategy.auto.micro_batch_size={list(opts.micro_batch_size)}: {bad} do not divide the global "
                              f"batch per rank ({t.micro_batch_size} x {t.grad_accum} = {batch}), which every candidate keeps; "
                              f"sizes that do: {ok}")
        if opts.trials < 0 or opts.trial_steps < 2:
            raise ConfigError(f"strategy.auto.trials={opts.trials}, trial_steps={opts.trial_steps}: trials must be >= 0 "
                              "(0: run the plan's first) and trial_steps >= 2 (the first step is a warm-up, not timed)")
        if not 0 <= opts.trial_weight <= 1:
            raise ConfigError(f"strategy.auto.trial_weight={opts.trial_weight}: a weight in [0, 1] (1: the fastest measured "
                              "trial runs; 0: the plan's first of those that ran; 0.5: the geometric mean of plan and trial)")
        if any(e < 1 for e in opts.ep):
            raise ConfigError(f"strategy.auto.ep={list(opts.ep)}: expert-parallel sizes must be >= 1 (empty: every valid one)")
        for name, values, allowed in (("precision", opts.precision, ("fp32", "bf16", "fp16", "half")),
                                      ("ckpt", opts.ckpt, ("none", "full", "every_k", "selective")),
                                      ("stage", opts.stage, ("ddp", "zero1", "zero2", "zero3"))):
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                raise ConfigError(f"strategy.auto.{name}={list(values)}: values must be among {', '.join(allowed)} (at least one)")
        from memopt.strategies.pipeline import SCHEDULES

        bad = [v for v in opts.pp_schedule if v not in SCHEDULES]
        if bad or (opts.pp and not opts.pp_schedule):
            raise ConfigError(f"strategy.auto.pp_schedule={list(opts.pp_schedule)}: values must be among "
                              f"{', '.join(SCHEDULES)} (at least one while strategy.auto.pp=true)")

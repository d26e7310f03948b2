"""The one function that applies the selected strategies to the model and the optimizer.

The order is fixed and readable here (torchtitan style):

    model on meta
    -> attention implementation (flash_attn)
    -> activation checkpointing (+ activation offload)
    -> precision (parameter dtype, autocast, loss scaler)
    -> partitioner (ddp / zero1 / zero2 / zero3 flat groups; one rank is ddp with W=1)
    -> materialise and initialise from the seed (every rank holds the single-process weights)
    -> optimizer (fp32 master where needed; cpu_offload puts it and Adam on the host)

``MemoptEngine`` then runs forward/backward/step for the loop.
"""
from __future__ import annotations

import torch

from memopt.config import TrainConfig
from memopt.dist import DistContext
from memopt.engines.base import PrecisionEngine, category, retained
from memopt.memory.tracker import MemoryTracker
from memopt.models.gpt import GPT, init_tensor
from memopt.optim import ShardedAdamW, StepResult
from memopt.strategies.checkpointing import apply_checkpointing
from memopt.strategies.flash_attention import apply_flash_attention
from memopt.strategies.precision import Precision
from memopt.strategies.zero import STAGES, FlatGroup, Partitioner, plan_groups


def materialize(model: GPT, device: torch.device, dtype: torch.dtype, seed: int, tracker: MemoryTracker | None = None) -> GPT:
    """Allocate a meta-device model on ``device`` in ``dtype`` and fill it from the seed (no partitioning)."""
    memo: dict[int, torch.nn.Parameter] = {}
    with category(tracker, "params"):
        for mod in model.modules():  # one allocation per distinct parameter: ties are kept
            for name, p in mod._parameters.items():
                if p is not None:
                    if id(p) not in memo:
                        memo[id(p)] = torch.nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype), requires_grad=p.requires_grad)
                    mod._parameters[name] = memo[id(p)]
    with category(tracker, "temp"):
        model.init_weights(seed)  # float32 values drawn on the CPU, cast on copy
    return model


def _materialize_params(model: GPT, device: torch.device, dtype: torch.dtype) -> None:
    """Replace meta parameters by (empty) parameters on ``device``, keeping ties; storage comes later."""
    memo: dict[int, torch.nn.Parameter] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                if id(p) not in memo:
                    memo[id(p)] = torch.nn.Parameter(torch.empty(0, device=device, dtype=dtype), requires_grad=p.requires_grad)
                mod._parameters[name] = memo[id(p)]


def selected_stage(cfg: TrainConfig) -> tuple[str, int]:
    chosen = [n for n in STAGES if getattr(cfg.strategy, n, None) is not None]
    name = chosen[0] if chosen else "ddp"
    return name, STAGES[name]


def model_on_meta(cfg: TrainConfig, device: torch.device, tracker: MemoryTracker | None = None) -> GPT:
    """The GPT on ``meta`` with the model-level strategies applied, in this order, for every engine:
    FlashAttention kernels, then activation checkpointing (and offload of its inputs)."""
    s = cfg.strategy
    with torch.device("meta"):
        model = GPT(cfg.model)
    if s.flash_attn is not None:
        apply_flash_attention(model, device)
    if s.ckpt is not None:
        apply_checkpointing(model, s.ckpt, s.act_offload, tracker)
    return model


def build(cfg: TrainConfig, device: torch.device, ctx: DistContext | None = None, tracker: MemoryTracker | None = None) -> "MemoptEngine":
    s, ctx = cfg.strategy, ctx or DistContext()
    model = model_on_meta(cfg, device, tracker)
    precision = Precision.from_strategies(s.fp16, s.bf16)
    if s.chunk is not None:
        from memopt.strategies.chunk import build_chunk_engine

        return build_chunk_engine(cfg, device, ctx, tracker, model, precision)

    name, stage = selected_stage(cfg)
    if stage >= 1 and not ctx.enabled:
        import warnings

        warnings.warn(f"strategy {name} on one rank partitions nothing: it runs as plain data parallelism with "
                      "world size 1 (launch several ranks with trainer.nproc_per_node=N or torchrun)", stacklevel=2)
    scfg = getattr(s, name, None)
    bucket_mb = getattr(scfg, "bucket_mb", 25.0)
    plan = plan_groups(model, stage, bucket_mb, precision.param_dtype)
    _materialize_params(model, device, precision.param_dtype)
    groups = []
    for gname, members in plan:
        live = [(n, model.get_parameter(n), tuple(meta.shape)) for n, meta in members]
        g = FlatGroup(gname, live, ctx, precision.param_dtype, device, stage, tracker)
        g.materialize(lambda n, shape: init_tensor(n, shape, cfg.seed, cfg.model))
        groups.append(g)
    if tracker is not None:
        tracker.register_module(model)
    part = Partitioner(model, groups, stage, ctx, overlap=getattr(scfg, "overlap_comm", True), prefetch=getattr(scfg, "prefetch", True))
    off = s.cpu_offload
    optimizer = ShardedAdamW(groups, cfg.optim, precision, ctx, tracker, offload=off is not None,
                             pin_memory=getattr(off, "pin_memory", True))
    return MemoptEngine(model, part, optimizer, precision, device, ctx, tracker)


class MemoptEngine(PrecisionEngine):
    def __init__(self, model: GPT, partitioner: Partitioner, optimizer: ShardedAdamW, precision: Precision,
                 device: torch.device, ctx: DistContext, tracker: MemoryTracker | None):
        self.model, self.part, self.optimizer, self.precision = model, partitioner, optimizer, precision
        self.device, self.ctx, self.tracker = device, ctx, tracker

    def forward_backward(self, x, y, micro: int, n_micro: int) -> torch.Tensor:
        last = micro == n_micro - 1
        self.part.sync_this_backward = last or self.part.stage >= 2
        with retained(self.tracker), self.precision.autocast(self.device):
            _, loss = self.model(x, y)
        self.part.in_backward = True
        try:
            with category(self.tracker, "temp"):
                ((loss / n_micro) * self.precision.loss_scale).backward()
        finally:
            self.part.in_backward = False
        if last:
            self.part.finish_backward()
        elif self.part.stage >= 2:
            self.part.after_micro_backward()
        return loss.detach()

    def step(self, lr: float) -> StepResult:
        return self.optimizer.step(lr)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        for g in self.part.groups:
            g.gather()
        try:
            return {k: v.detach().float().cpu().clone() for k, v in self.model.state_dict().items()}
        finally:
            for g in self.part.groups:
                g.release()

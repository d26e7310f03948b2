"""``engine=memopt``: memopt's own implementation of precision, ddp / ZeRO 1-3 and ZeRO-Offload.

The second half of the composition order (the first is ``memopt.compose.model_on_meta``):

    precision (parameter dtype, autocast, loss scaler)
    -> partitioner (flat groups over the dp_shard dimension; one rank is ddp with W=1)
    -> materialise and initialise from the seed (every rank holds the single-process weights)
    -> optimizer (fp32 master where needed; cpu_offload puts it and Adam on the host)
"""
from __future__ import annotations

import warnings

import torch

from memopt.compose import materialize_params, model_on_meta
from memopt.engines.base import (PrecisionEngine, gather_over_ep, model_backward, model_forward, rank_key,
                                 refuse_unsupported)
from memopt.engines.memopt.flat import FlatGroup, plan_groups
from memopt.engines.memopt.partitioner import Partitioner
from memopt.errors import ConfigError
from memopt.optim.adamw import ShardedAdamW
from memopt.parallel.dims import expected_world, resolve_sizes
from memopt.optim.step import StepResult
from memopt.strategies.cpu_offload import offloads_params
from memopt.strategies.precision import Precision
from memopt.strategies.zero import selected_stage

NAME = LABEL = "memopt"
SUPPORTS = None  # every strategy that names no engine of its own (the chunk family names "chunk")
PARALLEL = ("dp_shard", "ep", "tp")  # mesh dimensions it uses (ep: experts' groups over edp; tp: +strategy=tp)


def validate(cfg) -> None:
    refuse_unsupported(cfg, NAME, LABEL, SUPPORTS)
    ep = resolve_sizes(cfg.parallel, expected_world(cfg))["ep"]
    if ep > 1 and cfg.strategy.cpu_offload is not None:
        raise ConfigError(f"parallel.ep={ep} with strategy cpu_offload is not built: the host optimizer step (gradients "
                          "moved to the host during the backward, one fused pass) norms and votes over one data-parallel "
                          "dimension, and expert groups live on edp; use parallel.ep=1 or drop cpu_offload")


def build(cfg, device: torch.device, dims, tracker) -> "MemoptEngine":
    model = model_on_meta(cfg, device, dims, tracker)
    precision = Precision.of(cfg)
    name, stage, opts = selected_stage(cfg)
    part_dim = dims.dp_shard
    if stage >= 1 and not part_dim.enabled and not offloads_params(cfg):  # zero3 + offload_param: parameters on the host
        warnings.warn(f"strategy {name} on one rank partitions nothing: it runs as plain data parallelism with "
                      "world size 1 (launch several ranks with trainer.nproc_per_node=N or torchrun)", stacklevel=2)
    plan = plan_groups(model, stage, getattr(opts, "bucket_mb", 0.0), precision.param_dtype, model.param_dims())
    materialize_params(model, device, precision.param_dtype)
    grad_dtype = precision.param_dtype if getattr(opts, "grad_dtype", "fp32") == "param" else torch.float32
    groups = []
    for gname, members, dim in plan:  # dim: another data-parallel dimension (MoE experts: edp), else part_dim
        live = [(n, model.get_parameter(n), tuple(meta.shape)) for n, meta in members]
        g = FlatGroup(gname, live, part_dim if dim is None else getattr(dims, dim), precision.param_dtype, device,
                      stage, tracker, grad_dtype, param_host=offloads_params(cfg))
        g.materialize(lambda n, shape: model.init_tensor(n, shape, cfg.seed))
        groups.append(g)
    tracker.register_module(model)
    part = Partitioner(model, groups, stage, part_dim, overlap=opts.overlap_comm, prefetch=stage == 3 and opts.prefetch)
    off = cfg.strategy.cpu_offload
    optimizer = ShardedAdamW([g for g in groups if not g.frozen], cfg.optim, precision, part_dim, tracker, offload=off is not None,
                             pin_memory=off is not None and off.pin_memory, tp=model.tensor_parallel)
    return MemoptEngine(model, part, optimizer, precision, device, dims, tracker)


class MemoptEngine(PrecisionEngine):
    def __init__(self, model, partitioner: Partitioner, optimizer: ShardedAdamW, precision: Precision,
                 device: torch.device, dims, tracker):
        self.model, self.part, self.optimizer, self.precision = model, partitioner, optimizer, precision
        self.device, self.dims, self.tracker = device, dims, tracker

    def forward_backward(self, x, y, micro: int, n_micro: int) -> torch.Tensor:
        last = micro == n_micro - 1
        self.part.sync_this_backward = last or self.part.stage >= 2
        loss = model_forward(self.model, self.precision, self.tracker, self.device, x, y)
        self.part.in_backward = True
        try:
            model_backward(self.model, loss, self.precision, self.tracker, n_micro)
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
            state = self.model.full_state({k: v.detach().float().cpu().clone() for k, v in self.model.state_dict().items()})
        finally:
            for g in self.part.groups:
                g.release()
        return gather_over_ep(state, self.model.param_dims(), self.dims)  # experts of the other ep ranks

    @torch.no_grad()
    def iter_full_state(self):
        """A flat group at a time (zero3: gathered, its weights yielded as views, released), then the tensors
        outside the groups. Tensor and expert parallelism assemble whole tensors across ranks: the whole dict then."""
        if self.model.tensor_parallel is not None or self.dims.ep.enabled:
            yield from self.full_state_dict().items()
            return
        seen = set()
        for g in self.part.groups:
            seen.update(id(p) for p in g.params)
            g.gather()
            try:
                for n, p in zip(g.names, g.params):
                    yield n, p.detach()
            finally:
                g.release()
        for k, v in self.model.state_dict(keep_vars=True).items():
            if id(v) not in seen:
                yield k, v.detach()

    # ---- resumable checkpoints ------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        return {rank_key(): {"optim": self.optimizer.state_dict(), "scaler": self.scaler_state()}}

    def checkpoint_model_units(self):
        """A flat group's fp32 copies at a time, then the tensors outside the groups (as ``iter_full_state``
        streams them), so a load holds one group's copy, not the model's (gpt_10b: 41 GB per rank). Tensor
        and expert parallelism take whole tensors of other ranks apart: the whole dict then."""
        if self.model.tensor_parallel is not None or self.dims.ep.enabled:
            yield from super().checkpoint_model_units()
            return
        seen = set()
        for g in self.part.groups:
            seen.update(id(p) for p in g.params)
            yield {n: torch.empty(shape, dtype=torch.float32) for n, shape in zip(g.names, g.shapes)}
        yield {k: torch.empty(v.shape, dtype=torch.float32) for k, v in self.model.state_dict(keep_vars=True).items()
               if id(v) not in seen}

    def load_model_unit(self, unit: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.model.tensor_parallel is not None or self.dims.ep.enabled:
            return unit
        self._load_weights(unit)
        return {}

    @torch.no_grad()
    def load_checkpoint(self, model: dict[str, torch.Tensor], state: dict) -> None:
        if model:  # tensor or expert parallelism (checkpoint_model_units); else the units are applied already
            self._load_weights(self.model.local_state(model))  # tp: this rank's rows of the saved full tensors
        mine = state[rank_key()]
        self.optimizer.load_state_dict(mine["optim"])
        self.load_scaler_state(mine["scaler"])

    @torch.no_grad()
    def _load_weights(self, model: dict[str, torch.Tensor]) -> None:
        """Copy the weights ``model`` names into the flat groups (every rank's whole buffer, or its zero3
        shard) and the buffers; names it lacks are left as they are."""
        for g in self.part.groups:
            for name, off, n in zip(g.names, g.offsets, g.numels):
                if name not in model:
                    continue
                val = model[name].reshape(-1)
                if g.stage == 3:
                    a, b = max(g.lo, off), min(g.hi, off + n)
                    if a < b:
                        g.shard[a - g.lo : b - g.lo].copy_(val[a - off : b - off])
                else:
                    g.full[off : off + n].copy_(val)
        for name, buf in self.model.named_buffers():
            if name in model:
                buf.copy_(model[name])

"""The parameter-server engine (``+strategy=ps``, options and rules in ``memopt/strategies/ps.py``).

memopt's flat groups with no collective of their own (each rank's gradients stay in its full
gradient buffer), and a step that moves them point to point:

    every rank   forward + backward into its flat gradient buffers
    push         workers: send each trainable group's gradient to rank 0; rank 0 receives and sums
    step         rank 0 only: AdamW over the sum (times 1/W, as ddp) on its weights, in place
    pull         rank 0: send each group's weights (and the step's norm) to every worker; workers receive

The server's optimizer runs as on one process (its dimension has no process group, so none of the
step's collectives runs) over the summed gradients times 1/W: ddp's average, exactly when W is a
power of two. fp16's overflow vote and tensor parallelism's norm would need collectives: refused.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from memopt.compose import materialize_params, model_on_meta
from memopt.engines.base import refuse_unsupported
from memopt.engines.memopt.engine import MemoptEngine
from memopt.engines.memopt.flat import FlatGroup, plan_groups
from memopt.engines.memopt.partitioner import Partitioner
from memopt.optim.adamw import ShardedAdamW
from memopt.optim.step import StepResult
from memopt.parallel.dims import Dim
from memopt.strategies.precision import Precision

NAME, LABEL = "ps", "the parameter-server engine"
SUPPORTS = ("ps", "bf16", "ckpt", "act_offload", "flash_attn", "chunked_loss", "compile", "lora")
PARALLEL = ("dp_shard",)
CHECKPOINTS = False  # the optimizer lives on rank 0 alone; resumable checkpoints are not built for it
SERVER = 0


def validate(cfg) -> None:
    refuse_unsupported(cfg, NAME, LABEL, SUPPORTS)


def build(cfg, device: torch.device, dims, tracker) -> "PSEngine":
    model = model_on_meta(cfg, device, dims, tracker)
    precision = Precision.of(cfg)
    world = dims.dp_shard
    alone = Dim("ps_local")  # the groups' own dimension: no collective, each rank keeps its gradients
    plan = plan_groups(model, 0, cfg.strategy.ps.bucket_mb, precision.param_dtype, model.param_dims())
    materialize_params(model, device, precision.param_dtype)
    groups = []
    for gname, members, _ in plan:
        g = FlatGroup(gname, [(n, model.get_parameter(n), tuple(m.shape)) for n, m in members], alone,
                      precision.param_dtype, device, 0, tracker)
        g.materialize(lambda n, shape: model.init_tensor(n, shape, cfg.seed))
        groups.append(g)
    tracker.register_module(model)
    part = Partitioner(model, groups, 0, alone, overlap=False)
    trainable = [g for g in groups if not g.frozen]
    optimizer = ShardedAdamW(trainable, cfg.optim, precision, alone, tracker) if world.rank == SERVER else None
    return PSEngine(model, part, optimizer, precision, device, dims, tracker, trainable, world)


class PSEngine(MemoptEngine):
    """memopt's engine with the step replaced by push, server step, pull."""

    def __init__(self, model, part, optimizer, precision, device, dims, tracker, trainable, world: Dim):
        super().__init__(model, part, optimizer, precision, device, dims, tracker)
        self.trainable, self.world = trainable, world
        self.workers = [r for r in range(world.size) if r != SERVER]

    def _rank(self, r: int) -> int:
        """The global rank of coordinate ``r`` of the data-parallel dimension."""
        return dist.get_global_rank(self.world.group, r) if self.world.group is not None else r

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        if not self.world.enabled:
            return self.optimizer.step(lr)
        server = self.world.rank == SERVER
        with self.tracker.category("temp"):
            for g in self.trainable:  # push
                g.ensure_grad_buffer()
                grad = g.grad_shard if g.grad_shard is not None else g.flat_grad
                if server:
                    inbox = torch.empty_like(grad)
                    for w in self.workers:
                        dist.recv(inbox, src=self._rank(w), group=self.world.group)
                        grad.add_(inbox)
                    g.grad_shard = grad.mul_(1.0 / self.world.size)  # ddp's average (exact for W a power of 2)
                else:
                    dist.send(grad, dst=self._rank(SERVER), group=self.world.group)
            if server:
                res = self.optimizer.step(lr)
                news = torch.tensor([res.grad_norm, float(res.skipped), res.loss_scale], dtype=torch.float64)
            else:
                news = torch.empty(3, dtype=torch.float64)
            for g in self.trainable:  # pull (frozen groups never change)
                if server:
                    for w in self.workers:
                        dist.send(g.full, dst=self._rank(w), group=self.world.group)
                else:
                    dist.recv(g.full, src=self._rank(SERVER), group=self.world.group)
                    g.zero_grads()
            if server:
                for w in self.workers:
                    dist.send(news, dst=self._rank(w), group=self.world.group)
            else:
                dist.recv(news, src=self._rank(SERVER), group=self.world.group)
        norm, skipped, scale = news.tolist()
        return StepResult(bool(skipped), norm, scale)

    def checkpoint_state(self) -> dict:
        raise NotImplementedError("resumable checkpoints are not built for the parameter-server engine")

"""The pipeline engine (``+strategy=pipeline``): this rank's stages of the model, run by a
``torch.distributed.pipelining`` schedule over the ``pp`` dimension, with memopt's flat groups and
optimizer for everything else.

    meta model with the model-phase strategies (ckpt)  -> pruned to this rank's stages (stages.py)
    -> flat ddp groups over dims.dp_shard, initialised by name  -> PipelineStage per local stage
    -> the schedule (micro-batches = trainer.grad_accum)       -> ShardedAdamW with pp-wide norm/vote

The trainer hands micro-batches one at a time; the engine keeps them and runs the whole schedule on
the last one (earlier calls return a zero loss, the last the sum of the micro-batch losses, summed
over the pipeline so that every rank logs the loss the last stage computed). After the schedule:
the tied output layer's gradient is summed with the embedding's (first and last stage), then every
stage's gradients are all-reduced over its data-parallel ranks; the optimizer step sums the stages'
squared norms and overflow votes over pp.

Gradient buffers are allocated before the schedule, not on the first gradient as ``engine=memopt``
does: forwards and backwards of different micro-batches interleave, so they coexist with activations
in any case. Receive buffers that torch allocates for every micro-batch are counted as ``comm``.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from memopt.compose import materialize_params, model_on_meta
from memopt.engines.base import PrecisionEngine, rank_key, refuse_unsupported
from memopt.engines.memopt.flat import FlatGroup, plan_groups
from memopt.engines.pipeline.schedules import schedule_class
from memopt.engines.pipeline.stages import StageModule, prune, rank_stages, stage_ranges
from memopt.optim.adamw import ShardedAdamW
from memopt.optim.step import StepResult
from memopt.strategies.pipeline import MULTI, stage_blocks
from memopt.strategies.precision import Precision
from memopt.strategies.zero import selected_stage

NAME = "pipeline"
LABEL = "the pipeline engine"
SUPPORTS = ("pipeline", "ddp", "ckpt", "fp16", "bf16")
PARALLEL = ("pp", "dp_shard")


def validate(cfg) -> None:
    refuse_unsupported(cfg, NAME, LABEL, SUPPORTS)
    # imported at validation, before any tracker, not at the first build: its first import makes a module-level
    # tensor (microbatch.sum_reducer), which a tracker active at that build counts as 4 B of `other`, so the first
    # pipeline plan of a process differed from the next ones (and from plan mode's) by those bytes. Not at this
    # module's import either: that would import torch's compiler stack (and Triton) with memopt.engines.pipeline
    import torch.distributed.pipelining  # noqa: F401


def build(cfg, device: torch.device, dims, tracker) -> "PipelineEngine":
    opts = cfg.strategy.pipeline
    pp = dims.pp
    model = model_on_meta(cfg, device, dims, tracker)
    precision = Precision.of(cfg)
    ranges = stage_ranges(stage_blocks(opts, cfg.model.n_layer, pp.size))
    n_stages = len(ranges)
    mine = rank_stages(pp.rank, pp.size, n_stages)
    first, last = 0 in mine, n_stages - 1 in mine
    alias = prune(model, {i for k in mine for i in ranges[k]}, first, last)
    _, _, ddp = selected_stage(cfg)
    plan = plan_groups(model, 0, ddp.bucket_mb, precision.param_dtype)  # on meta: the shapes
    if alias:  # the tied output layer in a group of its own, left out of the gradient norm
        plan = [(n, [m for m in members if m[0] not in alias], d) for n, members, d in plan]
        plan = [g for g in plan if g[1]] + [("tied_head", [(n, model.get_parameter(n)) for n in alias], None)]
    materialize_params(model, device, precision.param_dtype)
    groups = []
    for gname, members, _ in plan:
        live = [(n, model.get_parameter(n), tuple(meta.shape)) for n, meta in members]
        g = FlatGroup(gname, live, dims.dp_shard, precision.param_dtype, device, 0, tracker)
        g.materialize(lambda n, shape: model.init_tensor(alias.get(n, n), shape, cfg.seed))
        g.norm_elsewhere = gname == "tied_head"
        groups.append(g)
    tracker.register_module(model)
    optimizer = ShardedAdamW([g for g in groups if not g.frozen], cfg.optim, precision, dims.dp_shard, tracker, pp=pp)
    return PipelineEngine(cfg, model, ranges, mine, groups, optimizer, precision, device, dims, tracker)


class PipelineEngine(PrecisionEngine):
    def __init__(self, cfg, model, ranges, mine, groups, optimizer, precision, device, dims, tracker):
        from torch.distributed.pipelining import PipelineStage

        self.cfg, self.model, self.groups, self.optimizer, self.precision = cfg, model, groups, optimizer, precision
        self.device, self.dims, self.tracker, self.pp = device, dims, tracker, dims.pp
        self.n_stages, self.mine = len(ranges), mine
        self.is_first, self.is_last = 0 in mine, self.n_stages - 1 in mine
        self.chunks = {k: StageModule(model, ranges[k], k == 0, k == self.n_stages - 1, precision, tracker, device)
                       for k in mine}
        self.tied = cfg.model.tie_embeddings
        self.embed_group = _embedding_group(dims) if self.tied else None
        stages = [PipelineStage(self.chunks[k], k, self.n_stages, device, group=self.pp.group, **self._shapes(k))
                  for k in mine]
        opts = cfg.strategy.pipeline
        cls = schedule_class(opts.schedule)
        self.n_micro = cfg.trainer.grad_accum
        target = stages if opts.schedule in MULTI else stages[0]
        self.schedule = cls(target, self.n_micro, loss_fn=self._loss, scale_grads=False)
        self.fake = dist.get_backend(self.pp.group) == "fake"  # the planner's simulated world (no data moves)
        if self.fake:
            self.schedule._warmup_p2p = _static_without_vote
        self._stages = stages
        self._xs, self._ys, self._losses = [], [], []
        self._comm_tagged = False
        self._busy = self._wall = 0.0  # seconds in the stages' compute / in the schedule, this step
        for st in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(st, name, self._timed(getattr(st, name)))

    def _shapes(self, k: int) -> dict:
        """Stage k's input and output as meta tensors (torch's static mode): without them torch infers
        them at the first step by running a stage's forward and backward on uninitialised tensors, and
        that forward calls the loss function on them."""
        t = self.cfg.trainer
        hidden = (t.micro_batch_size, self.cfg.model.seq_len, self.cfg.model.d_model)
        dtype = self.precision.param_dtype  # the residual stream's dtype (autocast adds into it)
        if k == 0:
            inp = torch.empty(hidden[:2], dtype=torch.long, device="meta")
        else:
            inp = torch.empty(hidden, dtype=dtype, device="meta", requires_grad=True)
        out = torch.empty(hidden, dtype=torch.float32 if k == self.n_stages - 1 else dtype, device="meta",
                          requires_grad=True)
        return {"input_args": inp, "output_args": out}

    # ---- one step ---------------------------------------------------------------------------------
    def _loss(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function on the last stage: the model's ``loss_head`` (output layer and
        cross-entropy) as one process computes it; returns what is differentiated, as engine=memopt
        does: (loss / micro-batches) x loss scale."""
        with self.tracker.retained("activations"), self.precision.autocast(self.device):
            loss = self.model.loss_head(h, self.model.lm_head, y)[1]
        self._losses.append(loss.detach())
        return (loss / self.n_micro) * self.precision.loss_scale

    def forward_backward(self, x, y, micro: int, n_micro: int) -> torch.Tensor:
        self._xs.append(x)
        self._ys.append(y)
        if micro < n_micro - 1:
            return torch.zeros((), device=self.device)
        xs, ys = torch.cat(self._xs), torch.cat(self._ys)
        self._xs, self._ys, self._losses = [], [], []
        for g in self.groups:
            g.ensure_grad_buffer()
        args = (xs,) if self.is_first else ()
        self._busy, t0 = 0.0, time.perf_counter()
        with self.tracker.category("temp"):
            self.schedule.step(*args, target=ys if self.is_last else None, return_outputs=False)
        self._wall = time.perf_counter() - t0
        if not self._comm_tagged:
            self._tag_receive_buffers()
        total = torch.stack(self._losses).sum() if self._losses else torch.zeros((), device=self.device)
        self.pp.all_reduce_(total)  # the last stage's sum reaches every rank (the others add zero)
        self._sync_grads()
        return total

    def _sync_grads(self) -> None:
        """The tied embedding / output-layer gradients summed over the first and last stage (both
        then hold the single-process gradient), then each group all-reduced over dims.dp_shard."""
        if self.embed_group is not None and (self.is_first or self.is_last):
            name = "wte.weight" if self.is_first else "lm_head.weight"
            dist.all_reduce(self.model.get_parameter(name).grad, group=self.embed_group)
        for g in self.groups:
            if not g.frozen:
                g.sync_grads(async_op=False)
                g.finish_sync()

    def _tag_receive_buffers(self) -> None:
        """torch allocates one receive buffer per micro-batch (and its gradient's) on the first step and
        keeps them: communication buffers, not activations."""
        for st in self._stages:
            infos = [i for recv in st.args_recv_info.values() for i in recv]
            infos += [i for recv in getattr(st, "grad_recv_info", {}).values() for i in recv]
            for info in infos:
                if getattr(info, "buffer", None) is not None:
                    self.tracker.register(info.buffer, "comm")
        self._comm_tagged = True

    def step(self, lr: float) -> StepResult:
        return self.optimizer.step(lr)

    # ---- the bubble, measured ---------------------------------------------------------------------
    metrics_key = "pipeline"  # the trainer logs ``step_metrics`` under this key

    def _timed(self, fn):
        """``fn`` (a stage's forward / backward of one micro-batch) adding its seconds to this step's
        busy time. Host time: on a GPU it would time the kernel launches, not the kernels."""
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._busy += time.perf_counter() - t0
        return run

    def step_metrics(self) -> dict:
        """Each pipeline rank's idle share of the last schedule (1 - its stages' compute seconds / the
        schedule's seconds: the measured bubble, waiting on sends and receives included), gathered over
        pp (call on every rank), beside the schedule's formula for equal stages."""
        from memopt.engines.pipeline.schedules import planned_bubble

        if self.fake:  # the planner's world: no times to report, and no objects cross it
            return {"formula": planned_bubble(self.cfg)}
        idle = 1 - self._busy / self._wall if self._wall else None
        return {"idle": self.pp.gather_objects(idle), "formula": planned_bubble(self.cfg)}

    # ---- evaluation -------------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One batch through the stages in order, the activations passed with send / recv over pp; the
        last stage's loss broadcast to every rank."""
        self.model.eval()
        try:
            with self.tracker.category("temp"):
                return self._eval(x, y)
        finally:
            self.model.train()

    def _eval(self, x, y) -> float:
        pp, h = self.pp, None
        loss = torch.zeros((), device=self.device)
        shape = (*x.shape, self.cfg.model.d_model)
        for k in range(self.n_stages):
            if k % pp.size != pp.rank:
                continue
            if k == 0:
                h = x
            else:
                h = torch.empty(shape, dtype=self.precision.param_dtype, device=self.device)
                dist.recv(h, group=pp.group, group_src=(k - 1) % pp.size)
            h = self.chunks[k](h)
            if k == self.n_stages - 1:
                with self.precision.autocast(self.device):
                    loss = self.model.loss_head(h, self.model.lm_head, y)[1].float()
            else:
                dist.send(h.to(self.precision.param_dtype).contiguous(), group=pp.group, group_dst=(k + 1) % pp.size)
        pp.all_reduce_(loss)
        return float(loss.item())

    # ---- weights and checkpoints -------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's fp32 copies gathered over pp (a collective): the single-process state dict,
        the tied pair under both names."""
        mine = {k: v.detach().float().cpu().clone() for k, v in self.model.state_dict().items()}
        if self.fake:  # fake tensors do not pickle: the other stages' copies, made from the model's shapes
            return {**self._whole_shapes(), **mine}
        out = {}
        for part in self.pp.gather_objects(mine):
            out.update(part)
        return out

    def _whole_shapes(self) -> dict[str, torch.Tensor]:
        """Empty fp32 tensors of every weight of the single-process model (what the gather returns)."""
        from torch.utils._python_dispatch import _disable_current_modes

        from memopt.models import model_class

        with _disable_current_modes(), torch.device("meta"):
            shapes = {k: v.shape for k, v in model_class(self.cfg.model)(self.cfg.model).state_dict().items()}
        return {k: torch.empty(shape, dtype=torch.float32) for k, shape in shapes.items()}

    def checkpoint_state(self) -> dict:
        return {rank_key(): {"optim": self.optimizer.state_dict(), "scaler": self.scaler_state()}}

    @torch.no_grad()
    def load_checkpoint(self, model: dict[str, torch.Tensor], state: dict) -> None:
        own = self.model.state_dict()
        for g in self.groups:
            for name, off, n in zip(g.names, g.offsets, g.numels):
                if name in model:
                    g.full[off : off + n].copy_(model[name].reshape(-1))
        for name, buf in self.model.named_buffers():
            if name in model and name in own:
                buf.copy_(model[name])
        mine = state[rank_key()]
        self.optimizer.load_state_dict(mine["optim"])
        self.load_scaler_state(mine["scaler"])


def _static_without_vote(stages, has_backward, p2p_done) -> None:
    """The planner's fake process group delivers nothing, so torch's first-step vote (does every stage
    know its shapes?) would read no answer and fall back to inferring them by running the stages; every
    stage does know them (``PipelineEngine._shapes``), which is the vote's answer in a real run."""
    from torch.distributed.pipelining._utils import InferenceMode

    for st in stages:
        st._inference_mode = InferenceMode.STATIC


def _embedding_group(dims):
    """The process group of the first and last pipeline rank of this rank's pipeline (the ranks holding
    the tied embedding and output layer): the pp group itself for two stages; for more, one group per
    pipeline, created on every rank in the same order (``new_group`` is a collective)."""
    pp = dims.pp
    if pp.size == 2:
        return pp.group
    # pp is the outermost dimension of a mesh laid out as arange(world) (init_device_mesh): pipeline j holds
    # ranks j, j + per, ... Counted, not read from the mesh's tensor: the planner builds engines under
    # FakeTensorMode, where that tensor's values read as 0 (every pair was [0, 0])
    per = dims.world.size // pp.size
    mine = None
    for j in range(per):
        pair = [j, (pp.size - 1) * per + j]
        g = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = g
    return mine

"""``engine=deepspeed +strategy=pipeline``: DeepSpeed's ``PipelineModule`` and its pipeline engine as the
baseline of memopt's pipeline (``memopt/engines/pipeline``), on the same GPT, weights and loop.

The GPT is built on meta as memopt builds it, pruned to this rank's stage (blocks elsewhere become
``Identity``), and its kept parameters are initialised by name, so both engines start from the
single-process weights. DeepSpeed's layers are that model's own modules:

    0       TiedLayerSpec("embed", _Embed): wte (+ wpe) and dropout           first stage
    1..n    _Block(i): memopt's block i                                      its stage
    n + 1   _FinalNorm: ln_f                                                 last stage
    n + 2   TiedLayerSpec("embed", _Embed(head), identity): the tied wte copy last stage
            (untied models: _Head, holding lm_head)
    loss_fn the model's ``loss_head`` (output layer = the tied copy, cross-entropy), as one process

partition_method ``type:_Block`` gives each stage n / pp blocks (memopt's even split; the embedding
rides with the first, the norm and head with the last). DeepSpeed ties the embedding to the last
stage's copy itself: it broadcasts the first stage's weight at build and all-reduces the two gradients
over the tie group (``ReduceTiedGrads``), Megatron's embedding group.

One step: the trainer hands micro-batches one at a time; the last one runs DeepSpeed's ``train_batch``
(its 1F1B ``TrainSchedule``, PipeDream-Flush, and its gradient all-reduce over the data-parallel ranks
of each stage) with the optimizer step held back, and ``step(lr)`` then writes the learning rate and
runs DeepSpeed's own step (clipping, ``torch.optim.AdamW``). The gradient norm logged is memopt's
(every stage's squares summed over pp, the tied copy once); DeepSpeed's fp32 clipping computes its own
(``runtime.utils.clip_grad_norm_``: over the pipeline's ranks, but only the stage-0 rank adds its
gradients unless a parameter is marked model-parallel, so a later stage's gradients are left out of
the norm it clips with). Parity with memopt's pipeline therefore holds without clipping
(tests/pipeline/test_deepspeed_pipe.py); with clipping active the trajectories part.

What is built: fp32, schedule 1f1b (DeepSpeed's only training schedule), the even split, ddp over
each stage's data-parallel ranks. Refused before allocation: the other schedules, split lists and
balanced (DeepSpeed partitions by its own method), fp16/bf16, ckpt and every other strategy,
resumable checkpoints (DeepSpeed's pipeline writes per-layer files memopt's merge does not read),
plans (DeepSpeed does not run on fake tensors). Memory: the tracker counts parameters, gradients and
the optimizer states as memopt does; what DeepSpeed's schedule allocates is counted as it is kept
(forwards' outputs as activations, the rest temp), without re-tagging its buffers.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from memopt.engines.base import Engine, rank_key, refuse_unsupported
from memopt.errors import ConfigError
from memopt.optim.step import StepResult

NAME, LABEL = "deepspeed", "DeepSpeed's pipeline engine (PipelineModule)"
SUPPORTS = ("pipeline", "ddp")
PARALLEL = ("pp", "dp_shard")
CHECKPOINTS = False


def validate(cfg) -> None:
    refuse_unsupported(cfg, NAME, LABEL, SUPPORTS)
    c, p = cfg.strategy.pipeline, "strategy.pipeline"
    if c.schedule != "1f1b":
        raise ConfigError(f"{p}.schedule={c.schedule} with engine=deepspeed: DeepSpeed's pipeline engine trains with "
                          f"its own 1F1B schedule (TrainSchedule) only; use {p}.schedule=1f1b, or engine=memopt")
    if c.split is not None and c.split != "even":
        raise ConfigError(f"{p}.split={c.split} with engine=deepspeed: DeepSpeed's PipelineModule places the blocks "
                          f"by its partition method (memopt passes type:_Block, the even split); use {p}.split=even, "
                          "or engine=memopt")
    if cfg.model.dropout > 0:
        raise ConfigError(f"model.dropout={cfg.model.dropout} with engine=deepspeed +strategy=pipeline: the stages' "
                          "random streams would differ from one process's; use model.dropout=0, or engine=memopt")


class _Embed(nn.Module):
    """The first layer: token (+ learned position) embeddings and dropout, as ``GPT.forward`` starts."""

    def __init__(self, model, head: bool = False):
        super().__init__()
        self.wte = model.wte  # head: the last stage's tied copy, the token embedding alone
        self.wpe, self.drop = (None, None) if head else (model.wpe, model.drop)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        return self.drop(x)


class _Block(nn.Module):
    """Block i of the model (rotary tables made per call when the model uses them)."""

    def __init__(self, block, cfg):
        super().__init__()
        self.block, self.cfg = block, cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from memopt.models.gpt import rope_cache

        c = self.cfg
        rope = None if c.pos_emb == "learned" else rope_cache(x.shape[1], c.head_dim, x.device, c.rope_theta)
        return self.block(x, rope)


class _FinalNorm(nn.Module):
    def __init__(self, ln_f):
        super().__init__()
        self.ln_f = ln_f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)


class _Head(nn.Module):
    """The last layer of an untied model: holds the output layer (the loss function applies it)."""

    def __init__(self, lm_head):
        super().__init__()
        self.lm_head = lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _prune(model, keep: set[int], first: bool, last: bool, tied: bool) -> None:
    """Drop from the meta model what this rank's stage does not run; with tied embeddings the last stage
    keeps the token embedding (DeepSpeed's tied copy) and the output layer tied to it."""
    for i in range(len(model.blocks)):
        if i not in keep:
            model.blocks[i] = nn.Identity()
    if not first:
        model.wpe = None
        if not (last and tied):
            model.wte = None
    if not last:
        model.ln_f = model.lm_head = None


def build(cfg, device: torch.device, dims, tracker) -> "DeepSpeedPipeEngine":
    validate(cfg)
    from memopt.compose import materialize_params, model_on_meta
    from memopt.engines.deepspeed import _prepare_environment

    _prepare_environment(device, False)
    from deepspeed.pipe import PipelineModule, TiedLayerSpec

    pp = dims.pp.size
    n = cfg.model.n_layer
    model = model_on_meta(cfg, device, dims, tracker)
    stage = dims.pp.rank
    per = n // pp
    first, last = stage == 0, stage == pp - 1
    tied = cfg.model.tie_embeddings
    _prune(model, set(range(stage * per, (stage + 1) * per)), first, last, tied)
    with tracker.category("params"):
        materialize_params(model, device, torch.float32, storage=True)
    with tracker.category("temp"), torch.no_grad():
        for name, p in model.named_parameters():  # by name: the single-process values (the tied pair once)
            p.copy_(model.init_tensor(name, tuple(p.shape), cfg.seed))
    tracker.register_module(model)

    layers = [TiedLayerSpec("embed", _Embed, model, tied_weight_attr=["wte.weight"])]
    layers += [_Block(b, cfg.model) for b in model.blocks]  # Identity elsewhere: never run there
    layers.append(_FinalNorm(model.ln_f) if last else _FinalNorm(nn.Identity()))
    if tied:
        layers.append(TiedLayerSpec("embed", _Embed, model, head=True, forward_fn=_identity, tied_weight_attr=["wte.weight"]))
    else:
        layers.append(_Head(model.lm_head if last else nn.Identity()))

    def loss_fn(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return model.loss_head(h, model.lm_head, y)[1]

    with tracker.category("other"):
        net = PipelineModule(layers=layers, num_stages=pp, loss_fn=loss_fn, partition_method="type:_Block")
    return DeepSpeedPipeEngine(cfg, model, net, device, dims, tracker)


def _identity(module, h):
    return h


class DeepSpeedPipeEngine(Engine):
    def __init__(self, cfg, model, net, device, dims, tracker):
        import deepspeed

        self.cfg, self.model, self.device, self.dims, self.tracker = cfg, model, device, dims, tracker
        self.is_first, self.is_last = dims.pp.rank == 0, dims.pp.rank == dims.pp.size - 1
        o, t = cfg.optim, cfg.trainer
        decay, no_decay, seen = [], [], set()
        for p in net.parameters():
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                (decay if p.ndim >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, foreach=True)
        config = {"train_micro_batch_size_per_gpu": t.micro_batch_size, "gradient_accumulation_steps": t.grad_accum,
                  "train_batch_size": t.micro_batch_size * t.grad_accum * dims.dp.size,
                  "gradient_clipping": float(o.grad_clip), "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}
        with tracker.category("other"):
            self.ds, _, _, _ = deepspeed.initialize(model=net, optimizer=self.optimizer, config=config,
                                                    dist_init_required=False)
        with tracker.category("optim"):  # the moments AdamW would create at its first step, counted as memopt's
            for g in self.optimizer.param_groups:
                for p in g["params"]:
                    st = self.optimizer.state[p]
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
        self._xs, self._ys = [], []
        # the schedule's instructions run through the class's map (bound per instruction): this engine's
        # copy holds the optimizer step back (step(lr) runs it) and counts what a forward keeps
        from deepspeed.runtime.pipe import schedule

        cls, tr = type(self.ds), tracker

        def forward(engine, **kwargs):  # a forward's outputs stay in DeepSpeed's buffers until its backward
            with tr.retained("activations"):
                return cls._exec_forward_pass(engine, **kwargs)

        self.ds._INSTRUCTION_MAP = {**cls._INSTRUCTION_MAP, schedule.OptimizerStep: lambda engine, **kwargs: None,
                                    schedule.ForwardPass: forward}
        self._step = lambda: cls._exec_optimizer_step(self.ds)

    # ---- one step ---------------------------------------------------------------------------------
    def forward_backward(self, x, y, micro: int, n_micro: int) -> torch.Tensor:
        self._xs.append(x)
        self._ys.append(y)
        if micro < n_micro - 1:
            return torch.zeros((), device=self.device)
        batches = list(zip(self._xs, self._ys))
        self._xs, self._ys = [], []
        with self.tracker.category("temp"):
            mean = self.ds.train_batch(data_iter=iter(batches))  # the mean over micro-batches and dp
        return mean.detach().float() * n_micro  # the trainer sums over micro-batches and averages over dp

    def step(self, lr: float) -> StepResult:
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        norm = self._grad_norm()
        with self.tracker.category("temp"):
            self._step()
        return StepResult(False, norm, 1.0)

    @torch.no_grad()
    def _grad_norm(self) -> float:
        """Every stage's squared gradients summed over pp (the tied copy on the last stage left out: the first
        stage counts it), as one process's norm of the averaged gradients."""
        own = torch.zeros((), dtype=torch.float64)
        tied_copy = self.is_last and not self.is_first and self.cfg.model.tie_embeddings
        skip = {id(self.model.wte.weight)} if tied_copy else set()
        seen = set()
        for p in self.model.parameters():
            if id(p) in seen or id(p) in skip or p.grad is None:
                continue
            seen.add(id(p))
            own += p.grad.double().pow(2).sum()
        self.dims.pp.all_reduce_(own)
        return math.sqrt(float(own))

    @torch.no_grad()
    def eval_loss(self, x, y) -> float:
        self.ds.reset_activation_shape()  # an evaluation batch may have another shape than training's
        try:
            with self.tracker.category("temp"):
                loss = self.ds.eval_batch(iter([(x, y)]), num_micro_batches=1)
        finally:
            self.ds.reset_activation_shape()
            self.ds.module.train()
        return float(loss.float().item())

    # ---- weights ----------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's fp32 weights gathered over pp, under the single-process names."""
        mine = {k: v.detach().float().cpu().clone() for k, v in self.model.state_dict().items()}
        out = {}
        for part in self.dims.pp.gather_objects(mine):
            out.update(part)
        return out

    def checkpoint_state(self) -> dict:
        return {rank_key(): {}}

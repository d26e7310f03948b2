"""``engine=fsdp2``: the same GPT and the same loop, with sharding done by PyTorch's FSDP2
(``torch.distributed.fsdp.fully_shard``, per-parameter DTensor sharding on dim 0).

Mapping (memopt strategy -> FSDP2):

    zero3        ``fully_shard`` on every transformer block, then on the root (embeddings, final
                 LayerNorm, tied head), ``reshard_after_forward=True``: a block's parameters are
                 all-gathered for its forward, freed, and gathered again for its backward; gradients
                 are reduce-scattered per block. The same grouping as memopt's zero3.
    zero2        the same units with ``reshard_after_forward=False``: parameters stay gathered from
                 the forward to the end of the backward (FSDP2 frees them after the backward, so
                 between steps only the shards live), gradients are reduce-scattered per block.
    zero1, ddp   refused (``ConfigError``): FSDP2 always reduce-scatters gradients into shards, so
                 there is no "replicated gradients, sharded optimizer" mode, and plain replication is
                 DDP, not FSDP. Mapping them silently to zero2 would label a different memory profile
                 with their name; use engine=memopt or engine=deepspeed for them.
    no stage     refused: FSDP2 without sharding is not a baseline of anything.
    fp16/bf16    ``params=fp16|bf16``: ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)``
                 (the same dtype: memopt and DeepSpeed reduce gradients in the parameter dtype).
                 FSDP2's sharded parameters stay fp32 and double as the master weights; the
                 unsharded (gathered) parameters are low precision. ``params=fp32``: no policy, the
                 forward runs under ``torch.autocast`` only. In both forms the forward runs under
                 memopt's ``Precision.autocast`` exactly as with engine=memopt.
                 fp16 adds memopt's ``DynamicLossScaler`` (DeepSpeed semantics): the loss is scaled
                 before backward, all ranks agree on overflow (all-reduce MAX), an overflowing step is
                 skipped and the scale backs off after ``hysteresis`` overflows.
    cpu_offload  ``CPUOffloadPolicy`` on a CUDA device (shards, gradients and the AdamW step on the
                 host). On a CPU run it is refused in ``validate``: with the default pinned memory
                 PyTorch raises "Cannot access accelerator device when none is available", and with
                 ``pin_memory=False`` it runs but moves nothing (host and device are one memory), so a
                 "cpu_offload" label would be meaningless. Planned for GPU profiles
                 (``planner/engines/fsdp2.py``: shards, gradients and AdamW states on the host, the
                 all-gather's host->device and the gradients' device->host copies); checked against
                 the parameter count only (no GPU here to measure).
    tp           memopt's ``tp`` strategy (model phase, so before ``fully_shard``: torchtitan's order);
                 its parameters are plain tp-local tensors, so FSDP2 shards them over the 1-D dp_shard
                 mesh; the norm sums split parameters over tp. Needs dp_shard >= 2 (no HSDP with tp).
    ckpt, act_offload, flash_attn
                 the model's own code (memopt's ``ckpt`` strategy / attention slot), installed
                 before sharding; the recomputation runs each block through its module call, so
                 FSDP2's pre-forward hook re-gathers a resharded block.

Buckets and overlap: FSDP2 communicates per ``fully_shard`` unit (one transformer block) and
overlaps with its own streams on CUDA; it has no byte-sized buckets, so ``zero2.bucket_mb`` and
``overlap_comm``/``prefetch`` are not translated (on CPU/gloo the collectives are synchronous).

Optimizer: ``torch.optim.AdamW`` (foreach) over the DTensor shards with two groups (weight decay
on ndim >= 2 parameters only), the ``lr_at`` learning rate written into the param groups every
step, and memopt's shared step sequence (``memopt.optim.step``: overflow vote, unscale, global
norm from the local shards' squared norms summed over dp_shard, clip).
Gradient accumulation reduce-scatters every micro-batch (as memopt's zero2/zero3).

Memory accounting: the tracker's dispatch mode sees DTensor ops from the outside only, so the
shards are registered explicitly through their local tensors: sharded parameters -> ``params``,
sharded gradients -> ``grads`` (after every backward), Adam moments -> ``optim`` (created before
the first step). Gathered (unsharded) parameters live in per-parameter buffers that FSDP2 frees and
re-allocates with ``storage.resize_``, which the tracker cannot see; FSDP2's allocate/free calls
are wrapped to re-register them, so they count as ``params`` exactly while gathered (see
``_instrument_unshard``; memopt's zero3 re-registers its resized buffers the same way).
Approximate: all-gather inputs and reduce-scatter scratch buffers are counted in the category
active when FSDP2 allocates them (forward transients, or ``temp`` in the backward).
"""
from __future__ import annotations

import contextlib

import torch

from memopt.compose import model_on_meta
from memopt.engines.base import PrecisionEngine, model_backward, model_forward, rank_key, refuse_unsupported
from memopt.errors import ConfigError
from memopt.memory.tracker import HOST
from memopt.optim.step import StepResult, StepSequence
from memopt.parallel.dims import expected_world, resolve_sizes
from memopt.strategies.precision import Precision

NAME, LABEL = "fsdp2", "FSDP2"
SUPPORTS = ("zero2", "zero3", "cpu_offload", "fp16", "bf16", "ckpt", "act_offload", "flash_attn", "tp", "lora", "compile")
OFFLOADS_PARAMS_ALWAYS = True  # CPUOffloadPolicy moves the shards with the optimizer: no optimizer-only offload
PARALLEL = ("dp_replicate", "dp_shard", "tp")  # dp_replicate > 1 is HSDP: a 2-D (replicate, shard) mesh


def _cuda_device(cfg) -> bool:
    d = cfg.trainer.device
    return d == "cuda" or (d == "auto" and torch.cuda.is_available())


def offload_runs_here(cfg) -> bool:
    """Whether cpu_offload can run for ``cfg`` (validate's rule): on a CUDA device, or planned for another profile's."""
    return _cuda_device(cfg) or (cfg.trainer.mode == "plan" and cfg.hardware.name != "auto")


def validate(cfg) -> None:
    """Refuse what FSDP2 cannot run as memopt defines the strategy (engine=fsdp2 only)."""
    if cfg.engine.name != "fsdp2":
        return
    s = cfg.strategy
    for n in ("zero1", "ddp"):
        if getattr(s, n) is not None:
            raise ConfigError(
                f"strategy {n} has no FSDP2 equivalent: fully_shard always reduce-scatters gradients into shards "
                "(that is zero2: +strategy=zero2 with engine=fsdp2); for "
                f"{'sharded optimizer states with replicated gradients' if n == 'zero1' else 'plain data parallelism'} "
                "use engine=memopt or engine=deepspeed")
    refuse_unsupported(cfg, NAME, LABEL, SUPPORTS)
    if s.zero2 is None and s.zero3 is None:
        raise ConfigError("engine=fsdp2 needs a sharding strategy: +strategy=zero3 (reshard_after_forward=True) "
                          "or +strategy=zero2 (reshard_after_forward=False)")
    sizes = resolve_sizes(cfg.parallel, expected_world(cfg))
    if sizes["tp"] > 1 and (sizes["dp_replicate"] > 1 or sizes["dp_shard_mod_ep"] * sizes["ep"] < 2):
        raise ConfigError(
            f"engine=fsdp2 with parallel.tp={sizes['tp']} needs parallel.dp_shard >= 2 and parallel.dp_replicate=1 (got "
            f"dp_shard={sizes['dp_shard_mod_ep'] * sizes['ep']}, dp_replicate={sizes['dp_replicate']}): fully_shard runs "
            "on the dp_shard dimension after tensor parallelism (torchtitan's order); with nothing to shard use "
            "engine=memopt, and tp with HSDP is not built")
    # plan mode allocates nothing and plans for the hardware profile's device (the planner gives its own answer),
    # unless that profile is this CPU's (hardware=auto here, with or without a device budget): the run it plans
    # is the one refused below (auto chose it in plan mode, and the run was refused)
    if s.cpu_offload is not None and not offload_runs_here(cfg):
        raise ConfigError(
            f"strategy cpu_offload with engine=fsdp2 needs a CUDA device (trainer.device={cfg.trainer.device} runs on "
            "the CPU here): FSDP2's CPUOffloadPolicy keeps shards in pinned host memory and copies them to the "
            "accelerator, which PyTorch refuses without one ('Cannot access accelerator device when none is "
            "available'), and unpinned it would move nothing (host and device are the same memory); "
            "use engine=memopt or engine=deepspeed for cpu_offload on CPU")


def _ensure_process_group(device: torch.device) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():  # one process: FSDP2 still needs a process group (world size 1)
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl", store=dist.HashStore(), rank=0, world_size=1)


def _mesh(dims, device: torch.device):
    """FSDP2's mesh: the dp_shard dimension, or (dp_replicate, dp_shard) for HSDP."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rep = dims.sizes["dp_replicate"]
    if rep > 1 and dims.mesh is not None and dims.mesh.mesh_dim_names == ("dp_replicate", "dp_shard_mod_ep"):
        return dims.mesh  # the run's own mesh and groups, not a second mesh's (which a planner's fake group cannot make)
    if rep > 1:  # dp_shard = 1 (replicas of an unsharded model): the run's mesh has no shard dimension
        return init_device_mesh(device.type, (rep, dims.dp_shard.size), mesh_dim_names=("dp_replicate", "dp_shard"))
    return dims.dp_shard.mesh if dims.dp_shard.mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))


def build(cfg, device: torch.device, dims, tracker) -> "FSDP2Engine":
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from torch.distributed.tensor import distribute_tensor

    validate(cfg)
    s = cfg.strategy
    _ensure_process_group(device)
    precision = Precision.of(cfg)
    model = model_on_meta(cfg, device, dims, tracker)

    mesh = _mesh(dims, device)
    low = precision.param_dtype if precision.param_dtype != torch.float32 else None
    mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low)
    off = CPUOffloadPolicy(pin_memory=bool(s.cpu_offload.pin_memory)) if s.cpu_offload is not None else OffloadPolicy()
    reshard = s.zero3 is not None
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=off)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=off)

    # materialise the shards and fill them with the single-process values (each rank slices its own)
    param_device = torch.device("cpu") if s.cpu_offload is not None else device
    with tracker.category("params"), _on_host(tracker, s.cpu_offload is not None):
        model.to_empty(device=param_device)
    with torch.no_grad(), tracker.category("temp"):
        for name, p in model.named_parameters():  # distinct parameters: the tied head appears once
            full = model.init_tensor(name, tuple(p.shape), cfg.seed).to(p.dtype)
            shard = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(shard.to_local())

    decay, no_decay = [], []
    for p in model.parameters():  # the trainable ones: frozen parameters (model.freeze, lora) get no state
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    o = cfg.optim
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=o.lr, betas=tuple(o.betas), eps=o.eps, foreach=True)
    return FSDP2Engine(model, optimizer, precision, device, dims, tracker, cfg.optim.grad_clip, s.cpu_offload is not None)


def _on_host(tracker, offload: bool):
    """Offloaded shards, their optimizer states and the step are host memory: on a GPU the tracker
    places CPU tensors there itself; the planner's fake step runs on the CPU and needs the scope."""
    return tracker.host_scope() if offload else contextlib.nullcontext()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class FSDP2Engine(PrecisionEngine):
    def __init__(self, model, optimizer, precision, device, dims, tracker, grad_clip: float, offload: bool = False):
        self.model, self.optimizer, self.precision, self.offload = model, optimizer, precision, offload
        self.device, self.dims, self.tracker, self.grad_clip = device, dims, tracker, grad_clip
        self.params = [p for p in model.parameters() if p.requires_grad]  # trainable: frozen ones have no grad, no state
        tp = model.tensor_parallel  # +strategy=tp: split parameters' squared norms are summed over tp too
        self.tp = tp.dim if tp is not None and tp.dim.enabled else None
        split = tp.sharded if self.tp is not None else set()
        self.tp_split = [n in split for n, p in model.named_parameters() if p.requires_grad]
        with tracker.category("optim"), _on_host(tracker, offload):  # Adam's moments, created now as torch would on the first step
            for p in self.params:
                st = optimizer.state[p]
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if tracker.enabled:
            where = HOST if offload else None  # states DTensor made out of the tracker's sight are placed here
            for p in model.parameters():
                tracker.register(_local(p), "params", device=where)
            for p in self.params:
                for k in ("exp_avg", "exp_avg_sq"):
                    tracker.register(_local(optimizer.state[p][k]), "optim", device=where)
            for b in model.buffers():
                tracker.register(b, "other")
            self._instrument_unshard()

    def _instrument_unshard(self) -> None:
        """FSDP2 keeps one all-gather output buffer per parameter and frees/re-allocates it with
        ``storage.resize_`` (0 after resharding, full size before the next gather). The tracker sees
        a storage when an op creates it, not when it is resized, so each buffer would count at full
        size forever. Each FSDPParam's allocate/free is wrapped to re-register its buffers: they count
        as ``params`` while gathered and as 0 bytes while freed (memopt re-registers its own resized
        zero3 buffers the same way)."""
        tr = self.tracker

        def refresh(fp):
            for t in getattr(fp, "all_gather_outputs", []):
                tr.register(t, "params")

        def wrap(fp, name):
            orig = getattr(fp, name)

            def wrapped(*a, **k):
                out = orig(*a, **k)
                refresh(fp)
                return out

            setattr(fp, name, wrapped)

        for m in self.model.modules():
            state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
            group = getattr(state, "_fsdp_param_group", None) if state is not None else None
            for fp in getattr(group, "fsdp_params", None) or []:
                for name in ("init_all_gather_outputs", "alloc_all_gather_outputs", "free_unsharded_param"):
                    wrap(fp, name)

    def forward_backward(self, x, y, micro: int, n_micro: int) -> torch.Tensor:
        loss = model_forward(self.model, self.precision, self.tracker, self.device, x, y)
        model_backward(self.model, loss, self.precision, self.tracker, n_micro)
        if self.tracker.enabled:
            for p in self.params:
                if p.grad is not None:
                    self.tracker.register(_local(p.grad), "grads")
        return loss.detach()

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        with _on_host(self.tracker, self.offload):
            return self._step(lr)

    def _step(self, lr: float) -> StepResult:
        """The shared step sequence over the local shards (FSDP2 averaged the gradients already), then AdamW.
        Its collectives run on the compute device (offloaded shards are on the host, which NCCL cannot reduce)."""
        have = [p.grad is not None for p in self.params]
        grads = [_local(p.grad) for p, h in zip(self.params, have) if h]
        split = [s for s, h in zip(self.tp_split, have) if h]
        dev = grads[0].device if grads else self.device
        seq = StepSequence(self.precision, self.grad_clip, self.dims.dp_shard, summed_over=1, device=self.device, tp=self.tp)
        bad = None
        if self.precision.scaler is not None:
            bad = torch.zeros((), dtype=torch.float32, device=dev)
            for g in grads:
                bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
        if seq.skip(bad.to(self.device) if bad is not None else None):
            self.optimizer.zero_grad(set_to_none=True)
            return seq.skipped()
        if seq.inv != 1.0:
            torch._foreach_mul_(grads, seq.inv)
        sq = torch.zeros((), dtype=torch.float32, device=dev)
        # this rank's split gradients' part of sq, when tp is on (the sequence adds the other tp ranks')
        mine = torch.zeros((), dtype=torch.float32, device=dev) if self.tp is not None else None
        for g, s in zip(grads, split):  # shards are disjoint: the squared norms of the local shards sum to the global one
            part = g.float().pow(2).sum()
            sq = sq + part
            if s and mine is not None:
                mine = mine + part
        norm, coef = seq.clip(sq.to(self.device), sharded=True, split_sq=mine.to(self.device) if mine is not None else None)
        if coef is not None:
            torch._foreach_mul_(grads, coef)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return seq.done(norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in self.model.state_dict().items():
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[k] = full.detach().float().cpu().clone()
        return self.model.full_state(out)

    @torch.no_grad()
    def iter_full_state(self):
        """A tensor at a time: each sharded parameter gathered whole (a collective), copied, dropped.
        With tensor parallelism the whole dict (its tp gather assembles the split tensors)."""
        if self.tp is not None:
            yield from self.full_state_dict().items()
            return
        for k, v in self.model.state_dict().items():
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            yield k, full.detach().to("cpu", torch.float32, copy=True)
            del full

    # ---- resumable checkpoints: the sharded DTensors as they are (DCP writes each rank's shards) ----
    # With +strategy=tp the DTensors are dp_shard shards of tp-local tensors: the two tp ranks' shards
    # carry the same name and offsets, so DCP would keep one. The weights are then saved whole
    # (single-process tensors, gathered over tp and dp_shard: what merge reads) and each rank slices
    # its rows and its shard back; the optimizer states keep their DTensors under ``optim_tp<t>``,
    # one key space per tp rank (the mesh, hence each rank's tp coordinate, is checked on resume).
    def _optim_key(self) -> str:
        return "optim" if self.tp is None else f"optim_tp{self.tp.rank}"

    def checkpoint_model(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict()) if self.tp is None else self.full_state_dict()

    def checkpoint_model_to_load(self) -> dict[str, torch.Tensor]:
        return self.checkpoint_model()  # each rank reads back the same part it saved

    def checkpoint_state(self) -> dict:
        optim = {name: dict(self.optimizer.state[p]) for name, p in self.model.named_parameters() if p.requires_grad}
        return {self._optim_key(): optim, rank_key(): {"scaler": self.scaler_state()}}

    @torch.no_grad()
    def load_checkpoint(self, model: dict[str, torch.Tensor], state: dict) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        if self.tp is not None:  # single-process tensors: this tp rank's rows, then this dp rank's shard
            model = self.model.local_state(model)
        for name, t in self.model.state_dict().items():  # DCP loaded in place; copy what it did not
            src = model[name]
            if src is t:
                continue
            if isinstance(t, DTensor) and not isinstance(src, DTensor):
                src = distribute_tensor(src.to(t.dtype), t.device_mesh, t.placements, src_data_rank=None)
            _local(t).copy_(_local(src))
        optim = state[self._optim_key()]
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            live = self.optimizer.state[p]
            for k, v in optim[name].items():
                if v is not live[k]:
                    _local(live[k]).copy_(_local(v))
        self.load_scaler_state(state[rank_key()]["scaler"])

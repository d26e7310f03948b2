"""``engine=deepspeed``: the same GPT and the same loop, with the selected strategies implemented by
DeepSpeed (``deepspeed.initialize``) instead of memopt. The baseline every memopt number is
compared against.

What is translated, and how (memopt strategy -> DeepSpeed config):

    ddp / no stage     zero_optimization.stage 0 (DeepSpeed all-reduces after the backward in
                       fixed 500M-element buckets: ``strategy.ddp.bucket_mb`` has no equivalent)
    zero1/zero2/zero3  zero_optimization.stage 1/2/3
    zero1/zero2        bucket_mb -> reduce_bucket_size and allgather_bucket_size, in elements of
                       the parameter dtype (the same conversion as memopt's buckets);
                       zero2.overlap_comm -> overlap_comm (zero1: false, memopt's zero1 reduces
                       once after the last micro-batch)
    zero3              memopt gathers and reduce-scatters one transformer block at a time and
                       prefetches one block ahead: reduce_bucket_size = one block's elements,
                       stage3_prefetch_bucket_size = one block's elements (0 with prefetch=false),
                       stage3_param_persistence_threshold = 0 (memopt partitions every parameter,
                       biases and LayerNorm weights included), stage3_max_reuse_distance = 0 and
                       stage3_max_live_parameters = 2 blocks (1 without prefetch): memopt frees a
                       block's gathered parameters after its forward and gathers them again for the
                       backward, holding at most the current and the prefetched block; DeepSpeed's
                       defaults (1e9 elements each) keep a model under 1e9 parameters entirely
                       gathered from forward to backward. overlap_comm = zero3.overlap_comm
    cpu_offload        offload_optimizer {device: cpu} (+ offload_param {device: cpu} under zero3 when
                       cpu_offload.offload_param, the default);
                       needs a ZeRO stage (DeepSpeed offloads a ZeRO optimizer only)
    fp16 (params=fp16) fp16 {initial_scale_power = log2(init_scale), loss_scale_window =
                       growth_interval, hysteresis, min_loss_scale = min_scale} (dynamic scaling
                       with factor 2, as memopt's defaults; other factors are refused)
    bf16 (params=bf16) bf16 (bf16 weights and grads, fp32 master in the optimizer)
    bf16 (params=fp32) torch_autocast {dtype: bfloat16}: fp32 weights, autocast forward (memopt's
                       default bf16 form). DeepSpeed reduces the gradients of Linear weights in
                       bf16 under torch_autocast (memopt reduces them in fp32): a rounding-level
                       difference, within the bf16 tolerance.
    ckpt, act_offload  the model's own checkpointing: memopt's ``ckpt`` strategy with the same
                       policy, installed on the GPT before DeepSpeed wraps it. DeepSpeed's
                       ``activation_checkpointing`` (partition_activations, cpu_checkpointing) only
                       applies to models calling ``deepspeed.checkpointing.checkpoint`` and fails on
                       a CPU device, so it is not used; act_offload is the same model-side code on
                       both engines, which keeps the comparison about the partitioner/optimizer.
    flash_attn         the same attention kernel swap (a model change)
    moe                deepspeed.moe.layer.MoE in place of memopt's MoE layers, with the same weights
                       (``memopt/engines/deepspeed_moe.py``: the translation and the gating
                       differences); parallel.ep -> ep_size; expert parameters in their own
                       optimizer groups, as DeepSpeed's ZeRO requires
    optim / trainer    train_micro_batch_size_per_gpu, gradient_accumulation_steps, gradient_clipping;
                       AdamW with optim.betas/eps and two parameter groups: weight decay on
                       ndim >= 2 parameters only. The learning rate of ``lr_at`` is written into the
                       optimizer's param groups before every step (no DeepSpeed scheduler).

Refused with a ``ConfigError`` (``validate``): strategies DeepSpeed has no equivalent for (any
strategy outside the table, e.g. chunk / hybrid_adam / static_partition), fp16 with
``params=fp32`` (DeepSpeed's fp16 keeps fp16 weights; its torch_autocast fp16 path does not use the
dynamic loss scaler memopt mirrors), a non-power-of-two ``init_scale``, growth/backoff factors other
than 2 / 0.5, fp16 at stage 0 (ddp or no stage: DeepSpeed 0.19.8's ``FP16_UnfusedOptimizer`` path
never scales the loss in ``engine.backward`` but unscales in ``step``, so gradients are
loss_scale times too small and small ones underflow; it also has no hysteresis),
cpu_offload without a ZeRO stage, and pass-through keys that would override what the shared loop
owns (optimizer, scheduler, batch sizes, accumulation, clipping).

Neutralised DeepSpeed artefact: at stage 0 with bf16 the same ``FP16_UnfusedOptimizer`` runs one
Adam step on zero gradients in its constructor (one weight decay at the initial lr on the master
weights, and Adam's step count one ahead); ``_undo_priming_step`` restores the masters to the copy
the constructor made and clears that state, so both engines start from the same point.

Optimizer choice: ``torch.optim.AdamW`` (foreach) without offload — it is the reference
implementation of the math memopt implements, and DeepSpeed runs any torch optimizer on its fp32
partitions (``zero_allow_untested_optimizer``); DeepSpeed's FusedAdam is a CUDA op and does not
exist on a CPU machine. With cpu_offload, ``deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)``:
it is what ZeRO-Offload is built for and DeepSpeed refuses other optimizers with offload by default
(``zero_force_ds_cpu_optimizer``); it compiles the ``cpu_adam`` C++ op on first use (about a minute,
then cached in torch's extension directory). Both compute decoupled weight decay
p *= 1 - lr * wd followed by bias-corrected Adam, as memopt does.

Pass-through: ``cfg.engine.deepspeed`` is a dict deep-merged last into the generated DeepSpeed
config, e.g. ``+engine.deepspeed.zero_optimization.contiguous_gradients=false`` or
``+engine.deepspeed.zero_optimization.reduce_bucket_size=1e6``. ``validate`` refuses keys owned
by the loop.

On a CPU machine DeepSpeed uses its CPU accelerator (``DS_ACCELERATOR=cpu`` is set when the device is
the CPU and the variable is unset); it reads the local device count from ``LOCAL_SIZE``, which is set
from the launcher's ``LOCAL_WORLD_SIZE``. The CPU accelerator reports fp16 unsupported unless oneDNN
has fp16 kernels (AVX512-FP16/AMX-FP16 CPUs); PyTorch's CPU fp16 ops run regardless (slowly), so with
fp16 on a CPU device that check is overridden for this process (a warning says so). DeepSpeed's
CPU backend's shared-memory workspace is unlinked once every rank has mapped it (``deepspeed_shm.py``:
it was left behind, ~69 MB of RAM per rank per run).

Memory accounting (the trainer's tracker wraps ``initialize`` and every step; totals are exact,
the split into categories is partly approximate). DeepSpeed allocates its buffers itself, so they
are re-tagged by walking the ZeRO optimizer's attributes (names of DeepSpeed 0.19 internals; an
attribute that is missing is skipped): after ``initialize``, the low-precision flat parameter
buffers and stage-3 partitions -> ``params`` (host under zero3 + cpu_offload, which also offloads
parameters); the fp32 master partitions and the Adam moments -> ``optim`` (host under cpu_offload);
stage 1/2 offload's host staging (the low-precision copy of the partition -> ``params``, the gradient
of the largest parameter -> ``grads``) and that gradient's device twin -> ``grads``; after every
backward, the IPG reduction buckets, the averaged gradient partitions and the stage-3 gradient
partition buffer -> ``grads``. ``initialize`` and the re-tag after it run in the tracker's
``placed_at_exit``: what DeepSpeed allocates there on the host counts on the host from its birth, as
on a GPU (on a CPU-only machine it would count under the device until the re-tag: with zero3 +
cpu_offload on one rank that made ``initialize`` the device peak, 14.87 MB on gpt_tiny). Adam
moments are created before the first step (both optimizers would create the same zeros lazily;
memopt creates them in its constructor) so they never pass through ``temp``. Gradients that land in ``param.grad`` (stage 0) are tagged ``grads``
by the module hook. Approximate: what ``initialize`` allocates and frees again is counted as
``other``; transient flattening/reduction scratch counts as ``temp`` (backward and step) or as
forward transients. Under zero3 each parameter is partitioned as it is made, as a DeepSpeed user's
``zero.Init`` does (``deepspeed_zero_init.py``): the init-time ``params`` peak is the partitions beside
one parameter whole (two at times: gloo's worker thread releases the previous parameter's broadcast buffer
just after the call returns); stages 0-2 materialise the whole fp32 model on every rank, as DeepSpeed keeps it.
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings

import torch

from memopt.compose import materialize, model_on_meta
from memopt.engines import deepspeed_moe, deepspeed_shm, deepspeed_zero_init
from memopt.engines.base import Engine, gather_over_ep, rank_key, refuse_unsupported, with_aux_loss
from memopt.errors import ConfigError
from memopt.optim.step import StepResult
from memopt.strategies.precision import Precision
from memopt.strategies.zero import selected_stage

NAME, LABEL = "deepspeed", "DeepSpeed"
SUPPORTS = ("ddp", "zero1", "zero2", "zero3", "cpu_offload", "fp16", "bf16", "ckpt", "act_offload", "flash_attn", "moe", "lora", "compile")
# DeepSpeed's data-parallel world and DeepSpeed-MoE's expert groups; MiCS/hpZ (replicate x shard) are not translated
PARALLEL = ("dp_shard", "ep")
LOOP_OWNED = ("optimizer", "scheduler", "train_batch_size", "train_micro_batch_size_per_gpu",
              "gradient_accumulation_steps", "gradient_clipping")


def validate(cfg) -> None:
    """Refuse what DeepSpeed cannot run the way memopt's strategy is defined (engine=deepspeed only)."""
    if cfg.engine.name != "deepspeed":
        return
    s = cfg.strategy
    refuse_unsupported(cfg, NAME, LABEL, SUPPORTS)
    deepspeed_moe.validate(cfg)
    if s.moe is not None and (cfg.trainer.checkpoint_every or cfg.trainer.resume):
        raise ConfigError("resumable checkpoints (trainer.checkpoint_every, trainer.resume) with +strategy=moe and "
                          "engine=deepspeed are not built (DeepSpeed-MoE's layers are named and sharded its own way); "
                          "use engine=memopt for MoE with checkpoints, or set trainer.checkpoint_every=0")
    if s.fp16 is not None:
        f = s.fp16
        if f.params != "fp16":
            raise ConfigError(
                f"strategy.fp16.params={f.params!r} with engine=deepspeed: DeepSpeed's fp16 mode keeps fp16 weights "
                "(its torch_autocast fp16 path has no dynamic loss scaler); use strategy.fp16.params=fp16 or engine=memopt")
        power = math.log2(f.init_scale) if f.init_scale > 0 else 0.5
        if power != int(power):
            raise ConfigError(
                f"strategy.fp16.init_scale={f.init_scale} with engine=deepspeed must be a power of two "
                "(DeepSpeed takes initial_scale_power = log2(init_scale))")
        if f.growth_factor != 2.0 or f.backoff_factor != 0.5:
            raise ConfigError(
                f"strategy.fp16.growth_factor={f.growth_factor} / strategy.fp16.backoff_factor={f.backoff_factor}: "
                "DeepSpeed's dynamic loss scaler only multiplies/divides by 2; use 2.0 / 0.5 with engine=deepspeed")
    name, stage, _ = selected_stage(cfg)
    if s.fp16 is not None and stage == 0:
        raise ConfigError(
            f"strategy fp16 with {'strategy ddp' if s.ddp is not None else 'no ZeRO stage'} and engine=deepspeed: "
            "DeepSpeed 0.19's stage-0 fp16 path (FP16_UnfusedOptimizer, used with a torch optimizer on CPU) "
            "unscales gradients in step() but engine.backward() never applies the loss scale, so gradients come "
            "out loss_scale times too small (and it ignores hysteresis); use fp16 with zero1/zero2/zero3, "
            "bf16, or engine=memopt")
    if s.cpu_offload is not None and stage == 0:
        raise ConfigError(
            "strategy cpu_offload with engine=deepspeed needs a ZeRO stage: DeepSpeed offloads a ZeRO optimizer "
            "(use +strategy=[zero1,cpu_offload], zero2 or zero3)")
    extra = cfg.engine.deepspeed or {}
    if not isinstance(extra, dict):
        raise ConfigError(f"engine.deepspeed must be a mapping of DeepSpeed config keys, got {type(extra).__name__}")
    owned = [k for k in extra if k in LOOP_OWNED]
    if owned:
        raise ConfigError(
            f"engine.deepspeed.{owned[0]} is set by memopt from the optim/trainer groups "
            f"({', '.join(LOOP_OWNED)}); change those instead")


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _elements(mb: float, dtype: torch.dtype) -> int:
    return max(1, int(mb * 2**20 / torch.tensor([], dtype=dtype).element_size()))


def ds_config(cfg, world_size: int, block_numel: int) -> dict:
    """The DeepSpeed config translated from the selected memopt strategies (see the module docstring)."""
    s, t, o = cfg.strategy, cfg.trainer, cfg.optim
    precision = Precision.of(cfg)
    name, stage, scfg = selected_stage(cfg)
    zero: dict = {"stage": stage}
    if stage in (1, 2):
        n = _elements(scfg.bucket_mb, precision.param_dtype)
        zero.update(reduce_bucket_size=n, allgather_bucket_size=n, overlap_comm=stage == 2 and scfg.overlap_comm,
                    contiguous_gradients=True, reduce_scatter=True)
    elif stage == 3:
        zero.update(reduce_bucket_size=block_numel, stage3_prefetch_bucket_size=block_numel if scfg.prefetch else 0,
                    stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
                    stage3_max_live_parameters=(2 if scfg.prefetch else 1) * block_numel,
                    overlap_comm=bool(scfg.overlap_comm), contiguous_gradients=True)
    if s.cpu_offload is not None:
        pin = bool(s.cpu_offload.pin_memory) and torch.cuda.is_available()
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
        if stage == 3 and s.cpu_offload.offload_param:
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    out = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch_size * t.grad_accum * world_size,
        "gradient_clipping": float(o.grad_clip),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if s.fp16 is not None:
        f = s.fp16
        out["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": int(round(math.log2(f.init_scale))),
                       "loss_scale_window": int(f.growth_interval), "hysteresis": int(f.hysteresis),
                       "min_loss_scale": float(f.min_scale)}
    elif s.bf16 is not None:
        if s.bf16.params == "bf16":
            out["bf16"] = {"enabled": True}
        else:
            out["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return _merge(out, dict(cfg.engine.deepspeed or {}))


def _prepare_environment(device: torch.device, fp16: bool) -> None:
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    os.environ.setdefault("LOCAL_RANK", "0")
    import torch.distributed as dist

    if not dist.is_initialized():  # one process: DeepSpeed still needs a process group (world size 1)
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl", store=dist.HashStore(), rank=0, world_size=1)
    import logging

    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    deepspeed_shm.init_comm_and_unlink_workspace()
    acc = get_accelerator()
    if fp16 and device.type == "cpu" and not acc.is_fp16_supported():
        warnings.warn("DeepSpeed's CPU accelerator reports fp16 unsupported on this CPU (no oneDNN fp16 kernels); "
                      "PyTorch's CPU fp16 ops run anyway, so engine=deepspeed overrides the check (slow, but exact)",
                      stacklevel=3)
        acc.is_fp16_supported = lambda: True  # instance attribute: this process only
        if torch.float16 not in acc.supported_dtypes():
            acc.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]


def build(cfg, device: torch.device, dims, tracker) -> "DeepSpeedEngine":
    validate(cfg)
    s = cfg.strategy
    _prepare_environment(device, s.fp16 is not None)
    import deepspeed

    model = model_on_meta(cfg, device, dims, tracker)
    stage3 = s.zero3 is not None
    if not stage3:  # the single-process weights on every rank (fp32; DeepSpeed casts to fp16/bf16 itself)
        materialize(model, device, torch.float32, cfg.seed, tracker)
    if s.moe is not None:  # DeepSpeed-MoE layers holding the weights memopt's MoE layers were given
        with tracker.category("params"):
            deepspeed_moe.swap_in(model, dims.ep.size)
    # memopt's zero3 unit: one transformer block (or the root group: embeddings, ln_f, tied head)
    in_blocks = {id(p) for p in model.blocks.parameters()}
    root_numel = sum(p.numel() for p in {id(p): p for p in model.parameters() if id(p) not in in_blocks}.values())
    block_numel = max(sum(p.numel() for p in model.blocks[0].parameters()) if len(model.blocks) else 0, root_numel, 1)
    config = ds_config(cfg, dims.dp.size, block_numel)

    if stage3:  # partitioned as made, as under zero.Init: no rank holds the whole model (deepspeed_zero_init.py)
        with tracker.placed_at_exit():  # offload_param's partitions are host memory from their birth
            # in DeepSpeed's parameter dtype: the precision's (fp16 keeps fp16 weights: params=fp32 is refused)
            deepspeed_zero_init.partition_at_init(model, config, Precision.of(cfg).param_dtype, device, cfg.seed, tracker)
            _retag_partitions(model, tracker, s.cpu_offload is not None and s.cpu_offload.offload_param)
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():  # distinct parameters (the tied head appears once)
        if id(p) not in seen and p.requires_grad:  # frozen parameters (model.freeze, lora): no optimizer state
            seen.add(id(p))
            ndim = len(p.ds_shape) if hasattr(p, "ds_shape") else p.ndim  # a ZeRO-3 partition's data is flat
            (decay if ndim >= 2 else no_decay).append(p)
    o = cfg.optim
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if s.moe is not None:
        groups = deepspeed_moe.optimizer_groups(groups)
    offload = s.cpu_offload is not None
    with tracker.category("optim"):
        if offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, adamw_mode=True)
        else:
            optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, foreach=True)
    # DeepSpeed allocates its offload buffers on the host itself; they are re-tagged after initialize, and
    # counted where they end from their birth (on a CPU-only machine they would count under the device
    # until the re-tag; on a GPU they are host memory from the start)
    with tracker.placed_at_exit():
        with tracker.category("other"):
            engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                         dist_init_required=False)
        _undo_priming_step(engine.optimizer, optimizer)
        precision = Precision.of(cfg)
        out = DeepSpeedEngine(engine, optimizer, precision, device, dims, tracker,
                              stage=config["zero_optimization"]["stage"], offload=offload)
        out._prime_optimizer_state()
        out._retag()
    return out


def _retag_partitions(model, tracker, on_host: bool) -> None:
    for p in model.parameters():
        if getattr(p, "ds_tensor", None) is not None and p.ds_tensor.numel():
            tracker.register(p.ds_tensor, "params", device="host" if on_host else None)


@torch.no_grad()
def _undo_priming_step(wrapper, base_optimizer) -> None:
    """Stage 0 with bf16 wraps the optimizer in DeepSpeed's ``FP16_UnfusedOptimizer``, whose
    constructor copies the low-precision weights into fp32 masters and then runs one optimizer step
    on zero gradients to create the Adam states. That step applies one weight decay at the initial lr
    to the masters (the low-precision weights are not refreshed) and advances Adam's step count, so
    every later bias correction lags one step. Neither is part of the training recipe, so it is undone
    exactly: the masters are copied again from the (untouched) low-precision weights, as the
    constructor first did, and the optimizer state is cleared (it is re-created at zero)."""
    if type(wrapper).__name__ != "FP16_UnfusedOptimizer":
        return
    for g16, g32 in zip(wrapper.fp16_groups, wrapper.fp32_groups):
        for p16, p32 in zip(g16, g32):
            p32.copy_(p16)
    base_optimizer.state.clear()


class DeepSpeedEngine(Engine):
    def __init__(self, ds, base_optimizer, precision, device, dims, tracker, stage: int, offload: bool):
        self.ds, self.base_optimizer, self.precision = ds, base_optimizer, precision
        self.model = ds.module
        self.device, self.dims, self.tracker, self.stage, self.offload = device, dims, tracker, stage, offload
        self._accumulate_on_host()

    def _accumulate_on_host(self) -> None:
        """ZeRO-1/2 with offload keeps the gradients of micro-batches before the last in host buffers it makes
        in the backward (``async_accumulate_grad_in_cpu_via_gpu``, one per parameter of the partition): counted
        on the host from their birth, as on a GPU (on a CPU-only machine they counted under the device)."""
        zo, tr = self.ds.optimizer, self.tracker
        inner = getattr(zo, "async_accumulate_grad_in_cpu_via_gpu", None)
        if not self.offload or tr is None or inner is None:
            return

        def on_host(param):
            with tr.host_scope():
                return inner(param)

        zo.async_accumulate_grad_in_cpu_via_gpu = on_host

    # ---- memory accounting ------------------------------------------------------------------------
    def _masters(self) -> list[torch.Tensor]:
        zo = self.ds.optimizer
        for attr in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition",
                     "fp32_groups_flat"):
            ts = getattr(zo, attr, None)
            if ts:
                return [t for t in ts if isinstance(t, torch.Tensor)]
        return [p for g in self.base_optimizer.param_groups for p in g["params"]]

    def _prime_optimizer_state(self) -> None:
        """Create the Adam moments now (both optimizers create them lazily on the first step, with
        exactly these values), so they are counted as ``optim`` like memopt's."""
        opt, tr = self.base_optimizer, self.tracker
        host = self.offload and tr is not None
        with tr.category("optim"), (tr.host_scope() if host else contextlib.nullcontext()):
            for p in self._masters():
                st = opt.state[p]
                if len(st):
                    continue
                if self.offload:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p.data, dtype=torch.float32)
                    st["exp_avg_sq"] = torch.zeros_like(p.data, dtype=torch.float32)
                else:
                    st["step"] = torch.tensor(0.0, dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _reg(self, obj, cat: str, device: str | None = None) -> None:
        """Re-tag every tensor in ``obj`` (a tensor, or nested dicts/lists/IPG buckets of them)."""
        if isinstance(obj, torch.Tensor):
            if obj.numel() and obj.device.type != "meta":
                self.tracker.register(obj, cat, device=device)
        elif isinstance(obj, dict):
            for v in obj.values():
                self._reg(v, cat, device)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                self._reg(v, cat, device)
        elif hasattr(obj, "buffer"):  # DeepSpeed's IPGBucket
            self._reg(obj.buffer, cat, device)

    def _retag(self) -> None:
        tr = self.tracker
        if tr is None:
            return
        tr.register_module(self.model)
        zo = self.ds.optimizer
        host = "host" if self.offload else None
        for attr in ("bit16_groups_flat", "lp_param_buffer", "fp16_partitioned_groups_flat", "fp16_groups_flat",
                     "bf16_groups_flat"):
            self._reg(getattr(zo, attr, None), "params", host if attr != "bit16_groups_flat" and self.stage == 3 else None)
        for p in self.model.parameters():
            self._reg(getattr(p, "ds_tensor", None), "params", host if self.stage == 3 else None)
        model_storage = {p.untyped_storage().data_ptr() for p in self.model.parameters() if p.numel()}
        for t in self._masters():
            if t.untyped_storage().data_ptr() not in model_storage:  # fp32 ZeRO-0 updates the weights in place
                self._reg(t, "optim", host)
        self._reg(list(self.base_optimizer.state.values()), "optim", host)
        # stage 1/2 offload's host staging: a low-precision copy of the partition (the updated weights on their
        # way back) and one gradient of the largest parameter; its device twin stays a device gradient buffer
        self._reg(getattr(zo, "param_buffer_of_bit16_for_cpu_offload_groups", None), "params", host)
        self._reg(getattr(zo, "temp_grad_buffer_for_cpu_offload", None), "grads", host)
        self._reg(getattr(zo, "temp_grad_buffer_for_gpu_offload", None), "grads")
        self._retag_grads()

    def _retag_grads(self) -> None:
        """Gradient partitions and DeepSpeed's reduction buckets (created in the first backward)."""
        if not self.tracker.enabled:  # nothing to re-tag: skip walking DeepSpeed's attributes
            return
        zo = self.ds.optimizer
        host = "host" if self.offload else None
        for attr in ("ipg_buckets", "averaged_gradients"):
            self._reg(getattr(zo, attr, None), "grads")
        self._reg(getattr(zo, "grad_partitions_flat_buffer", None), "grads", host)
        for t in self._masters():  # offload keeps the fp32 gradient partitions on the masters' .grad
            if t.grad is not None:
                self._reg(t.grad, "grads", host)

    # ---- the Engine interface ---------------------------------------------------------------------
    def forward_backward(self, x, y, micro: int, n_micro: int) -> torch.Tensor:
        with self.tracker.retained("activations"):
            loss = self.ds(x, y)[1]  # the logits die here: nothing holds them through the backward
        with self.tracker.category("temp"):
            self.ds.backward(with_aux_loss(self.model, loss))  # divides by gradient_accumulation_steps and applies the loss scale
            self._retag_grads()
            if micro != n_micro - 1:
                self.ds.step()  # not a boundary: DeepSpeed only advances its micro-step counter
        return loss.detach()

    def step(self, lr: float) -> StepResult:
        for g in self.base_optimizer.param_groups:
            g["lr"] = lr
        scale = self.loss_scale
        norm = self._own_grad_norm() if self.stage == 0 and self.precision.compute_dtype == torch.float32 else None
        self.ds.step()
        applied = self.ds.was_step_applied()
        if norm is None:
            norm = self.ds.get_global_grad_norm()
        if isinstance(norm, torch.Tensor):
            norm = norm.item()
        self._retag_after_step()
        return StepResult(not applied, float(norm) if (applied and norm is not None) else float("nan"), scale)

    @torch.no_grad()
    def _own_grad_norm(self) -> float | None:
        """Stage 0 in fp32 clips with torch's clip_grad_norm_ and keeps no norm: the same global
        norm, computed here from the (already averaged) gradients before DeepSpeed's step."""
        grads, seen = [], set()
        for p in self.model.parameters():
            if id(p) not in seen and p.grad is not None:
                seen.add(id(p))
                grads.append(p.grad.float().pow(2).sum())
        return math.sqrt(float(torch.stack(grads).sum())) if grads else None

    def _retag_after_step(self) -> None:
        host = "host" if self.offload else None
        for st in self.base_optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    self.tracker.register(v, "optim", device=host)

    @torch.no_grad()
    def eval_loss(self, x, y) -> float:
        self.ds.eval()
        try:
            with self.tracker.category("temp"):
                loss = self.ds(x, y)[1]  # the logits die here: nothing holds them through the backward
                if self.stage == 3:  # no backward follows: release what the forward gathered or prefetched
                    self.ds.empty_partition_cache()
            return float(loss.float().item())
        finally:
            self.ds.train()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        if self.stage == 3:
            import deepspeed

            self.ds.empty_partition_cache()  # nothing may be in flight while everything is gathered
            with deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None):
                return {k: v.detach().float().cpu().clone() for k, v in self.model.state_dict().items()}
        state = {k: v.detach().float().cpu().clone() for k, v in self.model.state_dict().items()}
        state, experts = deepspeed_moe.memopt_names(self.model, state)  # DeepSpeed-MoE's names -> memopt's
        return gather_over_ep(state, experts, self.dims)

    @torch.no_grad()
    def iter_full_state(self):
        """Stage 3: a module at a time, gathered on every rank, its weights yielded, released (the way
        DeepSpeed's own 16-bit consolidation walks the model); stages 0-2 hold the whole weights
        already: each as it is. DeepSpeed-MoE (renamed, experts gathered over ep): the whole dict."""
        if any(isinstance(m, deepspeed_moe.DeepSpeedMoE) for m in self.model.modules()):
            yield from self.full_state_dict().items()
            return
        if self.stage != 3:
            for k, v in self.model.state_dict().items():
                yield k, v.detach()
            return
        import deepspeed

        self.ds.empty_partition_cache()  # nothing may be in flight while modules are gathered in turn
        done = set()
        for prefix, m in self.model.named_modules():
            own = list(m.named_parameters(prefix=prefix, recurse=False))
            if own:
                done.update(n for n, _ in own)
                with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=None):
                    for n, p in own:
                        yield n, p.detach()
        for k, v in self.model.state_dict().items():  # the buffers
            if k not in done:
                yield k, v.detach()

    # ---- resumable checkpoints: DeepSpeed's own save/load (its files under <checkpoint>/deepspeed) ----
    def checkpoint_state(self) -> dict:
        return {rank_key(): {}}  # everything is in DeepSpeed's files; the DCP part holds the weights for merge

    def checkpoint_model_to_load(self) -> dict[str, torch.Tensor]:
        return {}  # DeepSpeed's own files restore the weights (load_files); the DCP part only serves merge

    def load_checkpoint(self, model: dict[str, torch.Tensor], state: dict) -> None:
        pass

    def save_files(self, path: str) -> None:
        self.ds.save_checkpoint(os.path.join(path, "deepspeed"), tag="state", save_latest=False)

    def load_files(self, path: str) -> None:
        self.ds.load_checkpoint(os.path.join(path, "deepspeed"), tag="state", load_optimizer_states=True,
                                load_lr_scheduler_states=False)
        self._retag_after_step()

    @property
    def loss_scale(self) -> float:
        if self.precision.scaler is None:
            return 1.0
        s = self.ds._get_optimizer_loss_scale()
        return float(s) if s is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        return int(self.ds.skipped_steps)

    @property
    def compute_dtype_name(self) -> str:
        return self.precision.name


"""Flat parameter groups: the storage behind ddp and ZeRO 1-3 in ``engine=memopt``.

Parameters are packed into flat groups: each group's full buffer (parameter dtype) holds its
parameters as views, padded to a multiple of the partition size W (the ``dp_shard`` dimension);
rank r of that dimension owns the contiguous slice r of every group (what each stage keeps: see
``memopt/strategies/zero.py``).

Groups: ``bucket_mb``-sized buckets in reverse registration order (the order gradients arrive)
for ddp/zero1/zero2; one group per block of the model (``Model.blocks``) plus one root group
(embeddings, final LayerNorm, tied head) for zero3, so a block is all-gathered just before its
forward, prefetched one block ahead, freed after it, and gathered again for its backward.

ddp and zero1 keep full gradients in a flat buffer and synchronise on the last micro-step only;
zero2 and zero3 reduce-scatter every micro-step into a shard (fp32, or the parameters' dtype with
``grad_dtype=param``) and free the full gradients at once. The hooks that drive all of this are in ``partitioner.py``.
"""
from __future__ import annotations

import math

import torch

from memopt.parallel import Dim


class FlatGroup:
    """A set of parameters packed into one flat buffer, sharded evenly over the ranks."""

    # the gradient norm leaves this group out: another rank counts the same values (pipeline
    # parallelism's tied output layer, a copy of the first stage's embedding and of its gradient)
    norm_elsewhere = False

    def __init__(self, name: str, params: list[tuple[str, torch.nn.Parameter, tuple[int, ...]]], ctx: Dim,
                 dtype: torch.dtype, device: torch.device, stage: int, tracker, grad_dtype: torch.dtype = torch.float32,
                 param_host: bool = False):
        self.param_host = param_host and stage == 3  # cpu_offload.offload_param: the zero3 shard lives on the host
        self.grad_dtype = grad_dtype  # zero2/zero3: dtype of the owned gradient shard (``strategy.zero2.grad_dtype``)
        self.name, self.ctx, self.dtype, self.device, self.stage, self.tracker = name, ctx, dtype, device, stage, tracker
        self.names = [n for n, _, _ in params]
        self.params = [p for _, p, _ in params]
        self.shapes = [tuple(shape) for _, _, shape in params]
        self.numels = [math.prod(shape) for shape in self.shapes]
        self.offsets, off = [], 0
        for n in self.numels:
            self.offsets.append(off)
            off += n
        self.numel = off
        W = ctx.size
        self.padded = math.ceil(max(off, 1) / W) * W
        self.shard_size = self.padded // W
        self.lo = ctx.rank * self.shard_size
        self.hi = self.lo + self.shard_size
        self.sharded = stage >= 1 and W > 1  # does this rank own only a slice?
        # every parameter frozen (``plan_groups`` never mixes): weights only, no gradient, no optimizer state
        self.frozen = bool(self.params) and not any(p.requires_grad for p in self.params)
        self.full: torch.Tensor | None = None
        self.shard: torch.Tensor | None = None  # zero3: the owned slice, persistent
        self.flat_grad: torch.Tensor | None = None  # ddp/zero1: persistent full gradient buffer
        self.grad_shard: torch.Tensor | None = None  # gradient of the owned range (fp32, or grad_dtype for zero2/3)
        self.host_grad = None  # cpu_offload: a ``memopt.optim.host_grads.HostGrad`` receiving the owned gradient
        self.pending: list = []  # in-flight async collectives
        self.ready = 0  # parameters whose gradient arrived this backward
        self.gather_work = None

    # ---- owned range in parameter coordinates (for weight decay segments) --------------------
    def owned_segments(self) -> list[tuple[int, int, int, str]]:
        """(start, end, ndim, name) within the owned slice for every parameter that intersects it."""
        lo, hi = (self.lo, self.hi) if self.sharded else (0, self.padded)
        out = []
        for name, off, n, shape in zip(self.names, self.offsets, self.numels, self.shapes):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append((a - lo, b - lo, len(shape), name))
        return out

    @property
    def owned_params(self) -> torch.Tensor:
        """The parameters of the owned range: the zero3 shard, the owned slice of the full buffer
        (zero1/zero2), or all of it (one rank, ddp)."""
        return self.shard if self.stage == 3 else self.full[self.lo : self.hi] if self.sharded else self.full

    @property
    def owned_size(self) -> int:
        return self.shard_size if self.sharded else self.padded

    # ---- materialisation ------------------------------------------------------------------
    def materialize(self, init_fn) -> None:
        """Allocate storage and fill the parameters from ``init_fn(name, shape) -> fp32 CPU tensor``."""
        with self.tracker.category("params"):
            if self.param_host:
                with self.tracker.host_scope():
                    self.shard = torch.zeros(self.shard_size, dtype=self.dtype, device="cpu",
                                             pin_memory=self.device.type == "cuda")
                self.full = torch.empty(self.padded, dtype=self.dtype, device=self.device)
            elif self.stage == 3:
                self.shard = torch.zeros(self.shard_size, dtype=self.dtype, device=self.device)
                self.full = torch.empty(self.padded, dtype=self.dtype, device=self.device)
            else:
                self.full = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        with self.tracker.category("temp"):
            for name, off, n, shape in zip(self.names, self.offsets, self.numels, self.shapes):
                if self.stage == 3:
                    a, b = max(self.lo, off), min(self.hi, off + n)
                    if a < b:
                        val = init_fn(name, shape).reshape(-1)
                        self.shard[a - self.lo : b - self.lo].copy_(val[a - off : b - off])
                else:
                    self.full[off : off + n].copy_(init_fn(name, shape).reshape(-1))
        for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes):
            p.data = self.full[off : off + n].view(shape)
        if self.stage == 3:
            self.release()
        if self.stage <= 1 and not self.frozen:
            with self.tracker.category("grads"):
                self.flat_grad = torch.empty(self.padded, dtype=self.dtype, device=self.device)
            self.free_grad_buffer()

    # ---- ddp/zero1 gradient buffer ---------------------------------------------------------
    # Gradients accumulate in place into views of one flat buffer per group (DDP's gradient-as-
    # bucket-view). The buffer is allocated when the group's first gradient of a step arrives (a
    # tensor hook runs before autograd accumulates) and freed after the optimizer step, so the
    # forward's activation peak never coexists with a full gradient buffer (as in DeepSpeed).
    @property
    def grad_buffer_allocated(self) -> bool:
        return self.flat_grad is not None and self.flat_grad.untyped_storage().nbytes() > 0

    def ensure_grad_buffer(self) -> None:
        """Allocate (zeroed) the flat gradient buffer and point every ``p.grad`` at its view."""
        if self.flat_grad is None or self.grad_buffer_allocated:
            return
        self.flat_grad.untyped_storage().resize_(self.padded * self.flat_grad.element_size())
        self.flat_grad.zero_()
        self.tracker.register(self.flat_grad, "grads")
        for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes):
            p.grad = self.flat_grad[off : off + n].view(shape)

    def free_grad_buffer(self) -> None:
        for p in self.params:
            p.grad = None
        self.flat_grad.untyped_storage().resize_(0)
        self.tracker.register(self.flat_grad, "grads")

    # ---- zero3 gather / release -------------------------------------------------------------
    def _resize(self, nbytes: int) -> None:
        self.full.untyped_storage().resize_(nbytes)
        self.tracker.register(self.full, "params")

    @property
    def gathered(self) -> bool:
        return self.full is not None and self.full.untyped_storage().nbytes() > 0

    def gather(self, async_op: bool = False) -> None:
        """zero3: materialise the full parameters from every rank's shard."""
        if self.stage != 3 or self.gathered or self.gather_work is not None:
            return
        self._resize(self.padded * self.full.element_size())
        shard = self.shard
        if self.param_host and self.device.type != "cpu":  # host shard -> device for the collective (NCCL)
            with self.tracker.category("temp"):
                shard = self.shard.to(self.device, non_blocking=True)
        if self.ctx.enabled:
            self.gather_work = self.ctx.all_gather(self.full, shard, async_op=async_op)
            if not async_op:
                self.gather_work = None
        else:
            self.full.copy_(shard)

    def wait_gather(self) -> None:
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work = None
        elif not self.gathered:
            self.gather()

    def release(self) -> None:
        """zero3: free the full parameters (the views stay valid and are refilled by ``gather``)."""
        if self.stage == 3 and self.full is not None:
            if self.gather_work is not None:
                self.wait_gather()
            self._resize(0)

    # ---- gradient synchronisation -----------------------------------------------------------
    def sync_grads(self, async_op: bool) -> None:
        """Reduce this group's gradients into the owned fp32 range (see the module docstring); the planner counts
        its ops' bytes as the gradient path's (``tracker.grad_path``)."""
        with self.tracker.grad_path():
            self._sync_grads(async_op)

    def _sync_grads(self, async_op: bool) -> None:
        if self.stage <= 1:
            self.ensure_grad_buffer()  # (a group that got no gradient still takes part in the collective)
            flat = self.flat_grad
        else:
            with self.tracker.category("temp"):
                flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
                for p, off, n in zip(self.params, self.offsets, self.numels):
                    if p.grad is not None:
                        flat[off : off + n].copy_(p.grad.reshape(-1))
                        p.grad = None
        if not self.ctx.enabled:
            self.pending.append((None, flat))
            return
        if self.stage == 0:
            work = self.ctx.all_reduce(flat, async_op=async_op)
            self.pending.append((work, flat))
        else:
            if flat is self.flat_grad:
                # zero1: reduce in place into this rank's slice of the full buffer (NCCL's and gloo's
                # in-place reduce-scatter: output = input + rank * shard), no shard-sized copy
                out = flat[self.lo : self.hi]
            else:
                with self.tracker.category("temp"):
                    out = torch.empty(self.shard_size, dtype=self.dtype, device=self.device)
            work = self.ctx.reduce_scatter(out, flat, async_op=async_op)
            self.pending.append((work, out, flat))

    def finish_sync(self) -> None:
        """Wait for in-flight collectives and accumulate their results into the fp32 owned gradient."""
        for work, result, *_ in self.pending:
            if work is not None:
                work.wait()
            self._accumulate(result)
        self.pending.clear()
        self.ready = 0

    def _accumulate(self, g: torch.Tensor) -> None:
        if self.host_grad is not None:  # cpu_offload: the owned range leaves the device now, bucket by bucket
            self.grad_shard = self.host_grad.receive(g, accumulate=self.grad_shard is not None)
            if self.flat_grad is not None:  # ddp/zero1 (synced on the last micro-step only): the full buffer is done
                self.free_grad_buffer()
            return
        if self.grad_shard is None:
            if g is self.flat_grad or (g._base is not None and g._base is self.flat_grad):
                # ddp: the full buffer; zero1: its reduced slice. Read in place, in any dtype: the
                # optimizer converts low-precision gradients to fp32 one group at a time
                self.grad_shard = g
                return
            if g.dtype == self.grad_dtype and g.numel() == self.owned_size and g is not self.flat_grad:
                self.grad_shard = g  # a fresh reduce-scatter output: adopt it
                self.tracker.register(g, "grads")
                return
            with self.tracker.category("grads"):
                self.grad_shard = g.to(self.grad_dtype) if g.dtype != self.grad_dtype else g.clone()
        else:
            self.grad_shard.add_(g.to(self.grad_dtype))

    def zero_grads(self) -> None:
        self.grad_shard = None
        self.ready = 0
        if self.flat_grad is not None:
            self.free_grad_buffer()
        else:
            for p in self.params:
                p.grad = None


def plan_groups(model, stage: int, bucket_mb: float, dtype: torch.dtype,
                param_dims: dict[str, str] | None = None) -> list[tuple[str, list, str | None]]:
    """Split the model's distinct parameters into (name, [(param_name, param)], dim) groups.

    ``param_dims`` (``Model.param_dims()``) names another data-parallel dimension for some
    parameters (MoE experts: ``edp``): they get groups of their own, planned the same way after the
    others and named ``<dim>_<group>``; dim None is the engine's own dimension. Without such
    parameters the plan is the one-dimension plan. Frozen parameters (``requires_grad=False``) are
    planned the same way after the trainable ones, in groups named ``frozen_<group>`` that hold no
    gradient and that the optimizer never sees (zero3: ``frozen_block<i>`` is gathered with ``block<i>``)."""
    param_dims = param_dims or {}
    named, seen = [], set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            named.append((name, p))
    plan = []
    for frozen in (False, True):  # frozen parameters (model.freeze, lora) in groups of their own, planned last
        pre = "frozen_" if frozen else ""
        mine = [(n, p) for n, p in named if n not in param_dims and p.requires_grad != frozen]
        plan += [(pre + g, members, None) for g, members in _plan(model, stage, bucket_mb, dtype, mine)]
        for dim in sorted(set(param_dims.values())):
            mine = [(n, p) for n, p in named if param_dims.get(n) == dim and p.requires_grad != frozen]
            plan += [(f"{pre}{dim}_{g}", members, dim) for g, members in _plan(model, stage, bucket_mb, dtype, mine)]
    return plan


def _plan(model, stage: int, bucket_mb: float, dtype: torch.dtype, named: list) -> list[tuple[str, list]]:
    """Groups of the parameters ``named`` (zero3: by block, then the root; else size buckets)."""
    if stage == 3:  # one group per block, then the root (model.block_params(): blocks, then the rest)
        by_name = dict(named)
        *blocks, root = model.block_params()
        groups = [(f"block{i}", [(n, by_name[n]) for n in names if n in by_name]) for i, names in enumerate(blocks)]
        groups.append(("root", [(n, by_name[n]) for n in root if n in by_name]))
        return [g for g in groups if g[1]]
    limit = max(1, int(bucket_mb * 2**20 / torch.tensor([], dtype=dtype).element_size()))
    groups, cur, size = [], [], 0
    for n, p in reversed(named):  # gradients arrive roughly in reverse order of registration
        if cur and size + p.numel() > limit:
            groups.append((f"bucket{len(groups)}", cur))
            cur, size = [], 0
        cur.append((n, p))
        size += p.numel()
    if cur:
        groups.append((f"bucket{len(groups)}", cur))
    return groups

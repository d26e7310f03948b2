"""Data parallelism and ZeRO stages 1-3 over flat parameter groups (Rajbhandari et al. 2020).

Parameters are packed into flat groups: each group's full buffer (parameter dtype) holds its
parameters as views, padded to a multiple of the world size W; rank r owns the contiguous slice
r of every group. What each stage keeps per rank (n parameters, fp32 Adam):

    ddp    params n, grads n, optimizer states for all n
    zero1  params n, grads n, optimizer states (and fp32 master) for n/W
    zero2  params n, grads n/W (+ one bucket in flight), optimizer states n/W
    zero3  params n/W (+ the blocks gathered for compute), grads n/W, optimizer states n/W

Groups: ``bucket_mb``-sized buckets in reverse registration order (the order gradients arrive)
for ddp/zero1/zero2; one group per transformer block plus one root group (embeddings, final
LayerNorm, tied head) for zero3, so a block is all-gathered just before its forward, prefetched
one block ahead, freed after it, and gathered again for its backward.

Gradient synchronisation is driven by post-accumulate-grad hooks: when every parameter of a group
has its gradient, the group is all-reduced (ddp) or reduce-scattered (zero1/2/3) asynchronously,
so communication overlaps the rest of the backward where the backend allows. ddp and zero1 keep
full gradients in a persistent flat buffer and synchronise on the last micro-step only; zero2 and
zero3 reduce-scatter every micro-step into an fp32 shard and free the full gradients at once.

A single process without any ZeRO strategy uses the same code with W=1 (the "plain" run).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from memopt.dist import DistContext, all_gather_single, reduce_scatter_single
from memopt.memory.tracker import MemoryTracker


@dataclass
class DdpConfig:
    """``+strategy=ddp``: replicate everything, all-reduce gradients (the reference for ZeRO)."""

    bucket_mb: float = 25.0  # gradient bucket size (MiB of parameters per all-reduce)


@dataclass
class Zero1Config:
    """``+strategy=zero1``: partition optimizer states (and fp32 master weights) across ranks."""

    bucket_mb: float = 25.0


@dataclass
class Zero2Config:
    """``+strategy=zero2``: also reduce-scatter gradients into owned shards during backward."""

    bucket_mb: float = 25.0  # DeepSpeed reduce_bucket_size analogue
    overlap_comm: bool = True  # launch each bucket's reduce-scatter asynchronously in backward


@dataclass
class Zero3Config:
    """``+strategy=zero3``: also partition parameters; gather one block at a time."""

    prefetch: bool = True  # gather the next block while the current one computes
    overlap_comm: bool = True


@dataclass
class CpuOffloadConfig:
    """``+strategy=cpu_offload`` (ZeRO-Offload): fp32 master weights and Adam states on the host,
    gradients streamed to the host, the Adam step on the host (``CPUAdamW``), updated parameters
    sent back. Alone it offloads a single rank's optimizer; with zero1/2/3 each rank offloads its shard."""

    pin_memory: bool = True  # pinned host buffers on CUDA for asynchronous copies


STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def _ctx(tracker: MemoryTracker | None, category: str):
    return tracker.category(category) if tracker is not None else _Null()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class FlatGroup:
    """A set of parameters packed into one flat buffer, sharded evenly over the ranks."""

    def __init__(self, name: str, params: list[tuple[str, torch.nn.Parameter, tuple[int, ...]]], ctx: DistContext,
                 dtype: torch.dtype, device: torch.device, stage: int, tracker: MemoryTracker | None):
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
        W = ctx.world_size
        self.padded = math.ceil(max(off, 1) / W) * W
        self.shard_size = self.padded // W
        self.lo = ctx.rank * self.shard_size
        self.hi = self.lo + self.shard_size
        self.sharded = stage >= 1 and W > 1  # does this rank own only a slice?
        self.full: torch.Tensor | None = None
        self.shard: torch.Tensor | None = None  # zero3: the owned slice, persistent
        self.flat_grad: torch.Tensor | None = None  # ddp/zero1: persistent full gradient buffer
        self.grad_shard: torch.Tensor | None = None  # fp32 gradient of the owned range
        self.pending: list = []  # in-flight async collectives
        self.ready = 0  # parameters whose gradient arrived this backward
        self.gather_work = None

    # ---- owned range in parameter coordinates (for weight decay segments) --------------------
    def owned_segments(self) -> list[tuple[int, int, torch.nn.Parameter]]:
        """(start, end) within the owned slice for every parameter that intersects it."""
        lo, hi = (self.lo, self.hi) if self.sharded else (0, self.padded)
        out = []
        for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append((a - lo, b - lo, len(shape)))
        return out

    @property
    def owned_size(self) -> int:
        return self.shard_size if self.sharded else self.padded

    # ---- materialisation ------------------------------------------------------------------
    def materialize(self, init_fn) -> None:
        """Allocate storage and fill the parameters from ``init_fn(name, shape) -> fp32 CPU tensor``."""
        with _ctx(self.tracker, "params"):
            if self.stage == 3:
                self.shard = torch.zeros(self.shard_size, dtype=self.dtype, device=self.device)
                self.full = torch.empty(self.padded, dtype=self.dtype, device=self.device)
            else:
                self.full = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        with _ctx(self.tracker, "temp"):
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
        if self.stage <= 1:
            with _ctx(self.tracker, "grads"):
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
        if self.tracker is not None:
            self.tracker.register(self.flat_grad, "grads")
        for p, off, n, shape in zip(self.params, self.offsets, self.numels, self.shapes):
            p.grad = self.flat_grad[off : off + n].view(shape)

    def free_grad_buffer(self) -> None:
        for p in self.params:
            p.grad = None
        self.flat_grad.untyped_storage().resize_(0)
        if self.tracker is not None:
            self.tracker.register(self.flat_grad, "grads")

    # ---- zero3 gather / release -------------------------------------------------------------
    def _resize(self, nbytes: int) -> None:
        self.full.untyped_storage().resize_(nbytes)
        if self.tracker is not None:
            self.tracker.register(self.full, "params")

    @property
    def gathered(self) -> bool:
        return self.full is not None and self.full.untyped_storage().nbytes() > 0

    def gather(self, async_op: bool = False) -> None:
        """zero3: materialise the full parameters from every rank's shard."""
        if self.stage != 3 or self.gathered or self.gather_work is not None:
            return
        self._resize(self.padded * self.full.element_size())
        if self.ctx.enabled:
            self.gather_work = all_gather_single(self.full, self.shard, async_op=async_op)
            if not async_op:
                self.gather_work = None
        else:
            self.full.copy_(self.shard)

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
        """Reduce this group's gradients into the owned fp32 range (see the module docstring)."""
        W = self.ctx.world_size
        if self.stage <= 1:
            self.ensure_grad_buffer()  # (a group that got no gradient still takes part in the collective)
            flat = self.flat_grad
        else:
            with _ctx(self.tracker, "temp"):
                flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
                for p, off, n in zip(self.params, self.offsets, self.numels):
                    if p.grad is not None:
                        flat[off : off + n].copy_(p.grad.reshape(-1))
                        p.grad = None
        if not self.ctx.enabled:
            self.pending.append((None, flat))
            return
        if self.stage == 0:
            work = dist.all_reduce(flat, async_op=async_op)
            self.pending.append((work, flat))
        else:
            if flat is self.flat_grad:
                # zero1: reduce in place into this rank's slice of the full buffer (NCCL's and gloo's
                # in-place reduce-scatter: output = input + rank * shard), no shard-sized copy
                out = flat[self.lo : self.hi]
            else:
                with _ctx(self.tracker, "temp"):
                    out = torch.empty(self.shard_size, dtype=self.dtype, device=self.device)
            work = reduce_scatter_single(out, flat, async_op=async_op)
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
        if self.grad_shard is None:
            if g is self.flat_grad or (g._base is not None and g._base is self.flat_grad):
                # ddp: the full buffer; zero1: its reduced slice. Read in place, in any dtype: the
                # optimizer converts low-precision gradients to fp32 one group at a time
                self.grad_shard = g
                return
            if g.dtype == torch.float32 and g.numel() == self.owned_size and g is not self.flat_grad:
                self.grad_shard = g  # a fresh reduce-scatter output: adopt it
                if self.tracker is not None:
                    self.tracker.register(g, "grads")
                return
            with _ctx(self.tracker, "grads"):
                self.grad_shard = g.float() if g.dtype != torch.float32 else g.clone()
        else:
            self.grad_shard.add_(g.float())

    def zero_grads(self) -> None:
        self.grad_shard = None
        self.ready = 0
        if self.flat_grad is not None:
            self.free_grad_buffer()
        else:
            for p in self.params:
                p.grad = None


def plan_groups(model, stage: int, bucket_mb: float, dtype: torch.dtype) -> list[tuple[str, list]]:
    """Split the model's distinct trainable parameters into (name, [(param_name, param)]) groups."""
    named, seen = [], set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            named.append((name, p))
    if stage == 3:
        groups = []
        for i, _ in enumerate(model.blocks):
            prefix = f"blocks.{i}."
            groups.append((f"block{i}", [(n, p) for n, p in named if n.startswith(prefix)]))
        groups.append(("root", [(n, p) for n, p in named if not n.startswith("blocks.")]))
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


class Partitioner:
    """Owns the flat groups of a model and the hooks that gather, free and synchronise them."""

    def __init__(self, model, groups: list[FlatGroup], stage: int, ctx: DistContext, overlap: bool = True,
                 prefetch: bool = True):
        self.model, self.groups, self.stage, self.ctx = model, groups, stage, ctx
        self.overlap, self.prefetch = overlap, prefetch
        self.sync_this_backward = True
        self.in_backward = False
        self.max_inflight = 2  # async collectives in flight before the oldest is waited for (bounds bucket memory)
        self._inflight: list[FlatGroup] = []
        self._group_of = {}
        for g in groups:
            for p in g.params:
                self._group_of[id(p)] = g
                if p.requires_grad:
                    if g.flat_grad is not None:  # ddp/zero1: the buffer must exist before autograd accumulates
                        p.register_hook(functools.partial(self._before_grad, g))
                    p.register_post_accumulate_grad_hook(self._on_grad)
        if stage == 3:
            self._install_zero3_hooks()

    # gradients --------------------------------------------------------------------------------
    @staticmethod
    def _before_grad(g: FlatGroup, grad: torch.Tensor) -> None:
        g.ensure_grad_buffer()

    def _on_grad(self, p) -> None:
        if not self.sync_this_backward:
            return
        g = self._group_of[id(p)]
        g.ready += 1
        if g.ready == sum(q.requires_grad for q in g.params):
            g.sync_grads(async_op=self.overlap and self.ctx.enabled)
            if g.pending and self.stage >= 2:
                self._inflight.append(g)
                while len(self._inflight) > self.max_inflight:
                    self._inflight.pop(0).finish_sync()  # frees that bucket's flat copy
            g.ready = -len(g.params)  # synced; ignore further hooks this backward
            if self.stage == 3 and g.name != "root":
                g.release()

    def finish_backward(self) -> None:
        """After the last micro-step's backward: sync groups whose hooks did not all fire, wait."""
        self._inflight.clear()
        for g in self.groups:
            if g.ready >= 0 and self._has_grads(g):
                g.sync_grads(async_op=False)
        for g in self.groups:
            g.finish_sync()
        if self.stage == 3:
            for g in self.groups:
                g.release()

    def after_micro_backward(self) -> None:
        """zero2/zero3 between micro-steps: reduce what is left and accumulate into the shards."""
        self._inflight.clear()
        for g in self.groups:
            if g.ready >= 0 and self._has_grads(g):
                g.sync_grads(async_op=False)
            g.finish_sync()
            if self.stage == 3:
                g.release()

    @staticmethod
    def _has_grads(g: FlatGroup) -> bool:
        if g.flat_grad is not None:
            return g.grad_buffer_allocated
        return any(p.grad is not None for p in g.params)

    # zero3 hooks ------------------------------------------------------------------------------
    def _install_zero3_hooks(self) -> None:
        by_name = {g.name: g for g in self.groups}
        root = by_name.get("root")
        blocks = [by_name.get(f"block{i}") for i in range(len(self.model.blocks))]

        def root_pre(_m, _args):
            if root is not None:
                root.gather()
            if blocks and blocks[0] is not None:
                blocks[0].gather(async_op=self.prefetch and self.ctx.enabled)

        def root_post(_m, _args, _out):
            if not torch.is_grad_enabled() and root is not None:
                root.release()

        self.model.register_forward_pre_hook(root_pre)
        self.model.register_forward_hook(root_post)
        for i, (block, g) in enumerate(zip(self.model.blocks, blocks)):
            if g is None:
                continue
            nxt = blocks[i + 1] if i + 1 < len(blocks) else None
            prv = blocks[i - 1] if i > 0 else None

            def pre(_m, _args, g=g, nxt=nxt):
                g.wait_gather()
                if nxt is not None and self.prefetch and not self.in_backward:
                    nxt.gather(async_op=self.ctx.enabled)

            def post(_m, _args, out, g=g, prv=prv):
                if not self.in_backward:
                    g.release()
                if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
                    return _GatherBeforeBackward.apply(out, g, prv if self.prefetch else None, self)
                return out

            block.register_forward_pre_hook(pre)
            block.register_forward_hook(post)


class _GatherBeforeBackward(torch.autograd.Function):
    """Identity whose backward gathers the block's parameters (and prefetches the previous block)
    before autograd reaches the block's own backward."""

    @staticmethod
    def forward(ctx, x, group, prev, part):
        ctx.group, ctx.prev, ctx.part = group, prev, part
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.group.wait_gather()
        if ctx.prev is not None:
            ctx.prev.gather(async_op=ctx.part.ctx.enabled)
        return grad, None, None, None

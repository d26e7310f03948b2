"""The hooks that drive flat groups (``flat.py``) through a step: gradient synchronisation for
ddp / ZeRO 1-3 and, for zero3, gathering each block's parameters before its forward and backward.

Gradient synchronisation is driven by post-accumulate-grad hooks: when every parameter of a group
has its gradient, the group is all-reduced (ddp) or reduce-scattered (zero1/2/3) asynchronously
over the partition dimension, so communication overlaps the rest of the backward where the backend
allows.
"""
from __future__ import annotations

import functools

import torch

from memopt.engines.memopt.flat import FlatGroup
from memopt.parallel import Dim


class Partitioner:
    """Owns the flat groups of a model and the hooks that gather, free and synchronise them."""

    def __init__(self, model, groups: list[FlatGroup], stage: int, ctx: Dim, overlap: bool = True,
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
            g.sync_grads(async_op=self.overlap and g.ctx.enabled)  # the group's own dimension (experts: edp)
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

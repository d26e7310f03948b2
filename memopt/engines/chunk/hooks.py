"""Module hooks that drive the tensor states (PatrickStar's pre/post forward and backward hooks).

Every module with parameters of its own (Linear, LayerNorm, Embedding, ...) gets:

* forward pre-hook: its tensors -> COMPUTE (chunks fetched and pinned); in a training forward its
  floating inputs are wrapped in ``_PostBackward``, an identity whose backward runs once the
  module's backward has produced the input gradient, i.e. when the module no longer needs its
  weights. Under activation checkpointing the same hook runs again for the recomputation (phase
  ``rec``), which brings the chunks back for it.
* forward hook: tensors -> HOLD_AFTER_FWD; the output is wrapped in ``_PreBackward``, an identity
  whose backward runs just before the module's backward: tensors -> COMPUTE again.
* ``_PostBackward``: tensors -> HOLD_AFTER_BWD.
* a post-accumulate-grad hook per trainable parameter: autograd has finished the gradient, so no
  later backward op reads the parameter (a tied one's hook fires after its last use); the gradient
  is written over the parameter's slice of its chunk (reuse) or added into the chunk's gradient
  companion (allocated at the first one of a step), and ``p.grad`` is dropped; the tensor
  is then HOLD_AFTER_BWD whatever the module hooks said. With 2+ ranks the manager reduces the
  chunk's unit when this was the unit's last missing gradient (comm.py).

Shared (tied) parameters, e.g. the token embedding used again by the LM head: a tensor counts its
current users, so it stays COMPUTE while any of its modules computes, and autograd fires its grad
hook once, after every use has contributed. Modules whose backward never runs (a frozen embedding)
are reset by ``ChunkManager.finish_backward``.
"""
from __future__ import annotations

import torch

from memopt.engines.chunk.chunk import TensorState
from memopt.engines.chunk.manager import ChunkManager


class _PreBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, hooks, name, infos):
        ctx.hooks, ctx.name, ctx.infos = hooks, name, infos
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.hooks.mgr.access(ctx.infos, ("bwd", ctx.name))
        return grad, None, None, None


class _PostBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, hooks, infos):
        ctx.hooks, ctx.infos = hooks, infos
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.hooks.mgr.release(ctx.infos, TensorState.HOLD_AFTER_BWD)
        return grad, None, None


def _wrap(x, fn, *args):
    if isinstance(x, torch.Tensor) and x.requires_grad:
        return fn.apply(x, *args)
    if isinstance(x, tuple):
        return tuple(_wrap(v, fn, *args) for v in x)
    return x


class ChunkHooks:
    def __init__(self, model: torch.nn.Module, mgr: ChunkManager):
        self.model, self.mgr = model, mgr
        self.handles = []
        for name, mod in model.named_modules():
            own = list(dict.fromkeys(p for p in mod._parameters.values() if p is not None))
            if not own:
                continue
            infos = [mgr.info(p) for p in own]
            self.handles.append(mod.register_forward_pre_hook(self._pre_forward(name, infos)))
            self.handles.append(mod.register_forward_hook(self._post_forward(name, infos)))
        for info in mgr.infos.values():
            if info.param.requires_grad:
                self.handles.append(info.param.register_post_accumulate_grad_hook(self._on_grad))

    def _training_forward(self) -> bool:
        return self.mgr.phase == "fwd" and torch.is_grad_enabled()

    def _pre_forward(self, name, infos):
        def hook(_mod, args):
            phase = {"bwd": "rec", "eval": "fwd"}.get(self.mgr.phase, self.mgr.phase)
            self.mgr.access(infos, (phase, name))
            if self._training_forward():
                return _wrap(args, _PostBackward, self, infos)
            return None

        return hook

    def _post_forward(self, name, infos):
        def hook(_mod, _args, out):
            self.mgr.release(infos, TensorState.HOLD_AFTER_FWD)
            if self._training_forward():
                return _wrap(out, _PreBackward, self, name, infos)
            return None

        return hook

    @torch.no_grad()
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        mgr = self.mgr
        info = mgr.info(p)
        c = info.chunk
        if mgr.comm is not None and not c.unit.gathered:  # e.g. an embedding: its backward never reads the weight
            mgr.gather([c.unit], ("grad", info.name))
        extra = 0 if c.has_grad or mgr.reuse else c.payload_bytes
        mgr.ensure([c], ("grad", info.name), extra=extra)
        mgr.take_grad(info, p.grad)
        p.grad = None
        info.users, info.state = 0, TensorState.HOLD_AFTER_BWD
        mgr.grad_arrived(info)  # with 2+ ranks: reduce the unit once all its gradients are in

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

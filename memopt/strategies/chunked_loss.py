"""``+strategy=chunked_loss``: the output projection and the cross-entropy, a chunk of tokens at a time.

The plain loss head materialises the logits x W^T (N tokens x V, N = batch x sequence) and autograd
keeps their fp32 log-softmax for the backward: 4 N V bytes of activations (plus the N V logits in
the compute dtype while they live), the largest activation of a GPT step at large vocabularies.
Here the forward computes each chunk's logits, its log-sum-exp and its share of the loss, and keeps
only the hidden states x (already kept by the final LayerNorm's backward) and the N log-sum-exps.
The backward recomputes each chunk's logits from x and W, forms softmax - one-hot for that chunk
and adds its products into dx and dW: one extra output projection (2 N V C FLOPs, a third of the
head's training FLOPs), and at most ``chunk_tokens`` x V logits alive at any moment.

The math is the plain head's: logits in the compute dtype (autocast's when it is on), softmax and
cross-entropy in fp32 (float64 inputs stay float64), mean over the tokens whose target is not ``ignore_index`` (-100, as
``F.cross_entropy``). dW is summed over chunks in fp32 (or float64) and cast to the weight's dtype once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from memopt.errors import ConfigError
from memopt.strategies.base import Build, Strategy, register

IGNORE_INDEX = -100  # F.cross_entropy's default: such targets add nothing to the loss nor to the count


@dataclass
class ChunkedLossConfig:
    """``+strategy=chunked_loss``: how many tokens' logits exist at once."""

    chunk_tokens: int = 1024  # tokens per chunk: peak logits bytes ~ chunk_tokens x V x (4 + compute dtype)


def _compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would run in here: autocast's when it is on for x's device, else x's."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(x.dtype, w.dtype)


def softmax_grad(logits: torch.Tensor, lse: torch.Tensor, t: torch.Tensor, coef: torch.Tensor, dtype: torch.dtype,
                 fused: bool) -> torch.Tensor:
    """d loss / d logits of a chunk, (c, V) in ``dtype``: (softmax - one-hot) x coef per row, the softmax as
    exp(logits - lse) in the loss dtype (lse's). ``fused`` (on a GPU) makes three passes over the chunk where the
    plain form makes five: the subtraction reads the compute-dtype logits and writes the loss dtype, the scale
    and the rounding to ``dtype`` are one ``out=`` multiply (the loss head profiled on an H100 was bound by these
    passes, experiments/strategies/README.md). Both give the same bits; on a CPU the mixed-dtype kernels of the
    fused form were slower (bf16: 2.0-2.6 s against 1.7-1.8 s at gpt_small's head), so it keeps the plain one."""
    p = (torch.sub(logits, lse[:, None]) if fused else logits.to(lse.dtype).sub_(lse[:, None])).exp_()
    p.scatter_add_(1, t.clamp_min(0)[:, None], -(t != IGNORE_INDEX)[:, None].to(p.dtype))  # - one-hot
    if fused and p.dtype != dtype:
        return torch.mul(p, coef[:, None], out=torch.empty(p.shape, dtype=dtype, device=p.device))
    return p.mul_(coef[:, None]).to(dtype)


class ChunkedCrossEntropy(torch.autograd.Function):
    """mean_i CE(x_i W^T, t_i) over rows of x (N, C) with W (V, C), targets (N,), never holding N x V."""

    @staticmethod
    def forward(ctx, x, w, targets, chunk: int):
        dtype = _compute_dtype(x, w)
        ctx.x_dtype, x = x.dtype, x.to(dtype)  # what the plain head's linear keeps (its autocast copy)
        acc = torch.promote_types(dtype, torch.float32)  # softmax and loss dtype: fp32 (float64 stays float64)
        n = x.size(0)
        lse = torch.empty(n, dtype=acc, device=x.device)
        total = torch.zeros((), dtype=acc, device=x.device)
        wc = w.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            for s in range(0, n, chunk):
                logits = F.linear(x[s:s + chunk], wc).to(acc)  # (c, V)
                t = targets[s:s + chunk]
                keep = t != IGNORE_INDEX
                lse[s:s + chunk] = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, t.clamp_min(0)[:, None]).squeeze(1)
                total += ((lse[s:s + chunk] - picked) * keep).sum()
        count = (targets != IGNORE_INDEX).sum()
        ctx.save_for_backward(x, w, targets, lse, count)
        ctx.chunk, ctx.dtype = chunk, dtype
        return total / count  # nan when every target is ignored, as F.cross_entropy

    @staticmethod
    def backward(ctx, grad):
        x, w, targets, lse, count = ctx.saved_tensors
        chunk, dtype = ctx.chunk, ctx.dtype
        scale = grad.to(lse.dtype) / count
        dx = torch.empty(x.shape, dtype=ctx.x_dtype, device=x.device) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(w.shape, dtype=lse.dtype, device=w.device) if ctx.needs_input_grad[1] else None
        wc = w.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            for s in range(0, x.size(0), chunk):
                xc, t = x[s:s + chunk], targets[s:s + chunk]
                keep = t != IGNORE_INDEX
                g = softmax_grad(F.linear(xc, wc), lse[s:s + chunk], t, (scale * keep), dtype, fused=x.is_cuda)
                if dx is not None:
                    dx[s:s + chunk] = g @ wc  # cast to x's dtype by the copy
                if dw is not None:
                    dw += g.t() @ xc
        return dx, (dw.to(w.dtype) if dw is not None else None), None, None


class ChunkedLoss:
    """The ``loss_head`` slot: no logits returned for a training forward (targets given)."""

    def __init__(self, chunk_tokens: int):
        self.chunk_tokens = chunk_tokens

    def __call__(self, x: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor | None):
        if targets is None:  # generation / inspection asks for the logits themselves
            return head(x), None
        if getattr(head, "bias", None) is not None:
            raise ValueError("chunked_loss expects an output layer without bias")
        flat = x.reshape(-1, x.size(-1))  # (N, C)
        tgt = targets.reshape(-1)
        # through the head's own call, so that engines hooking its module (the chunk engine fetches the
        # weight's chunk before the forward and again before the backward, where the loss recomputes
        # the logits from it) see the head used, as for the plain head's ``head(x)``
        head.forward = lambda h: ChunkedCrossEntropy.apply(h, head.weight, tgt, self.chunk_tokens)
        try:
            loss = head(flat)
        finally:
            del head.forward
        return None, loss


@register
class ChunkedLossStrategy(Strategy):
    name, Config, phase, order = "chunked_loss", ChunkedLossConfig, "model", 40

    def validate(self, opts, cfg) -> None:
        if opts.chunk_tokens < 1:
            raise ConfigError(f"strategy.chunked_loss.chunk_tokens={opts.chunk_tokens} must be >= 1 "
                              "(tokens whose logits exist at once; e.g. 1024)")

    def apply(self, model, opts, build: Build) -> None:
        model.loss_head = ChunkedLoss(opts.chunk_tokens)

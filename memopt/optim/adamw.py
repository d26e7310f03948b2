"""The optimizer step every memopt strategy shares, over the owned ranges of flat groups.

overflow vote -> unscale (loss scale and data-parallel averaging) -> global gradient-norm clip (the
shared ``StepSequence``) -> decoupled weight decay -> Adam -> copy the fp32 master back into the
parameters' dtype -> all-gather the updated shards (zero1/zero2).

fp32 master weights exist only where they differ from the parameters: with fp32 parameters the
owned slice of the parameters is updated in place; with fp16/bf16 parameters (or cpu_offload) an
fp32 master copy of the owned slice is kept (counted as ``optim`` bytes, as in the ZeRO paper).
With ``cpu_offload`` the master, the Adam moments and the step live on the host and run on
``CPUAdamW``; gradients are copied to the host and updated parameters copied back.
"""
from __future__ import annotations

import contextlib

import torch

from memopt.optim.step import StepResult, StepSequence
from memopt.parallel import Dim
from memopt.strategies.precision import Precision


def _ctx(tracker, category: str, host: bool = False):
    """The tracker's category (and host scope for offloaded bytes) for new storages."""
    stack = contextlib.ExitStack()
    stack.enter_context(tracker.category(category))
    if host:
        stack.enter_context(tracker.host_scope())
    return stack


SLICE = 1 << 20  # elements of a low-precision gradient converted to fp32 at a time in the step


class ShardedAdamW:
    """AdamW over the owned range of every flat group (everything, for one rank or ddp)."""

    def __init__(self, groups: list, cfg, precision: Precision, ctx: Dim, tracker, offload: bool = False,
                 pin_memory: bool = True, tp=None, pp=None):
        self.groups, self.cfg, self.precision, self.ctx, self.tracker = groups, cfg, precision, ctx, tracker
        self.pp = pp  # pipeline parallelism: the stages' norms and overflow votes are combined (``StepSequence``)
        self.offload = offload
        self.step_count = 0
        dev = groups[0].device if groups else torch.device("cpu")
        self.state_device = torch.device("cpu") if offload else dev
        pin = pin_memory and offload and dev.type == "cuda"
        self.master: list[torch.Tensor] = []
        # weight decay on matrices and embeddings (ndim >= 2), not on biases or LayerNorm weights
        self.decay_segments: list[list[tuple[int, int]]] = []
        for g in groups:
            src = g.owned_params
            if src.dtype == torch.float32 and not offload:
                self.master.append(src)  # update the parameters' own fp32 storage in place
            else:
                with _ctx(tracker, "optim", host=offload):
                    m = torch.empty(src.shape, dtype=torch.float32, device=self.state_device, pin_memory=pin)
                    m.copy_(src)
                self.master.append(m)
            self.decay_segments.append([(a, b) for a, b, ndim, _ in g.owned_segments() if ndim >= 2])
        # tensor parallelism (``tp``: the model's TPLayout): the owned ranges of split parameters, whose
        # squared norms differ between tp ranks and are summed over tp (replicated ones count once)
        self.tp = tp.dim if tp is not None and tp.dim.enabled else None
        self.tp_segments = [[(a, b) for a, b, _, n in g.owned_segments() if n in tp.sharded] if self.tp else []
                            for g in groups]
        self._cpu_adam = None
        if offload:  # the host Adam owns its moments (allocated eagerly, counted as host optim bytes)
            from memopt.optim.cpu_adam import CPUAdamW

            with _ctx(tracker, "optim", host=True):
                self._cpu_adam = CPUAdamW(self.master, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=0.0)
            self.exp_avg, self.exp_avg_sq = self._cpu_adam.exp_avg, self._cpu_adam.exp_avg_sq
            from memopt.optim.host_grads import attach_host_grads

            self.host_grads = attach_host_grads(groups, tracker)  # gradients reach the host during the backward
            self.runs = [_decay_runs(m.numel(), segs, cfg.weight_decay) for m, segs in zip(self.master, self.decay_segments)]
        else:
            with _ctx(tracker, "optim"):
                self.exp_avg = [torch.zeros_like(m) for m in self.master]
                self.exp_avg_sq = [torch.zeros_like(m) for m in self.master]

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        if self.offload and not any(gr.ctx is not self.ctx for gr in self.groups):
            return self._host_step(lr)
        grads = [g.grad_shard for g in self.groups]
        for i, g in enumerate(grads):
            if g is None:  # a group without gradients (frozen): zeros keep Adam's math uniform
                with self.tracker.category("grads"):
                    grads[i] = torch.zeros_like(self.groups[i].full if self.groups[i].stage != 3 else self.groups[i].shard, dtype=torch.float32)[: self.master[i].numel()]
        dev = grads[0].device if grads else torch.device("cpu")
        seq = StepSequence(self.precision, self.cfg.grad_clip, self.ctx, summed_over=self.ctx.size, device=dev, tp=self.tp,
                           pp=self.pp)
        bad = None
        if self.precision.scaler is not None:  # overflow check, agreed by every rank
            bad = torch.zeros((), dtype=torch.float32, device=dev)
            for g in grads:
                bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
        if seq.skip(bad):
            self.zero_grad()
            return seq.skipped()
        inv = seq.inv
        # fp32 gradients are scaled in place; low-precision ones (ddp/zero1 views of an fp16/bf16
        # buffer) are converted to fp32 SLICE elements at a time, once for the norm and again for
        # the update, so that no fp32 copy of the gradients exists (the temporary is a few MiB,
        # reused by the allocator)
        low = [g.dtype != torch.float32 for g in grads]
        f32 = [g for g, lo in zip(grads, low) if not lo]

        def slices(i: int) -> list[slice]:
            """Group i in pieces: SLICE elements at a time for low precision, whole for fp32."""
            return [slice(a, a + SLICE) for a in range(0, grads[i].numel(), SLICE)] if low[i] else [slice(None)]

        if inv != 1.0 and f32:
            torch._foreach_mul_(f32, inv)
        # global norm over the owned ranges (padding is zero); sum over ranks when sharded
        sq = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
        other = [i for i, gr in enumerate(self.groups) if gr.ctx is not self.ctx]  # over another dimension (experts: edp)
        for i, g in enumerate(grads):
            if i in other or self.groups[i].norm_elsewhere:  # (a tied copy another pipeline stage counts)
                continue
            for sl in slices(i):
                if low[i]:
                    with _ctx(self.tracker, "temp"):
                        x = g[sl].float()
                    if inv != 1.0:
                        x.mul_(inv)
                else:
                    x = g
                sq = sq + x.pow(2).sum()
                del x
        sharded = any(gr.sharded for gr in self.groups)
        if other:
            sq, sharded = self._norm_over_dims(sq, grads, other, inv), True
        norm, coef = seq.clip(sq, sharded=sharded, split_sq=self._split_sq(grads, low, inv) if self.tp is not None else None)
        if coef is not None and f32:
            torch._foreach_mul_(f32, coef)

        def fp32_grad(i: int, host: bool, sl: slice = slice(None)) -> torch.Tensor:
            """Group i's unscaled, clipped fp32 gradient (``sl`` of it; on the host for offload)."""
            g = grads[i][sl]
            with _ctx(self.tracker, "grads" if host else "temp", host=host):
                if host:  # the host copy (on a GPU, the device-to-host transfer)
                    x = g.to("cpu", torch.float32) if g.device.type != "cpu" else g.float() if low[i] else g.clone()
                elif low[i]:
                    x = g.float()
                else:
                    return g
            if low[i]:
                if inv != 1.0:
                    x.mul_(inv)
                if coef is not None:
                    x.mul_(coef)
            return x

        self.step_count += 1
        self._decay(lr)
        if self.offload:
            host_grads = [fp32_grad(i, host=True) for i in range(len(grads))]
            self._cpu_adam.step(host_grads, lr=lr)
            del host_grads
        else:
            for i in range(len(grads)):
                for sl in slices(i):
                    x = fp32_grad(i, host=False, sl=sl)
                    self._adam(i, x, lr, sl)
                    del x
        self._write_back()
        self.zero_grad()
        return seq.done(norm)

    def _host_step(self, lr: float) -> StepResult:
        """ZeRO-Offload's step on the host gradients ``HostGrad`` filled during the backward: one read
        of the gradients for the squared norm (which also detects fp16 overflow, as DeepSpeed's
        CPU-offload check does), then one fused kernel pass per element: unscale and clip (one factor),
        decoupled weight decay, Adam, and the copy into the parameters (fp16/bf16 rounding, or fp32)
        when they are host-addressable; then the zero1/zero2 all-gather. Parameters on a CUDA device
        are copied from the master after the pass (that copy is the host-to-device transfer)."""
        for h in self.host_grads:
            h.wait()
        grads = []
        for g, h in zip(self.groups, self.host_grads):
            if g.grad_shard is None:  # a group without gradients (frozen): zeros keep Adam's math uniform
                h.buf.zero_()
            grads.append(h.buf)
        dev = self.groups[0].device
        seq = StepSequence(self.precision, self.cfg.grad_clip, self.ctx, summed_over=self.ctx.size, device=dev)
        sq = _sum_sq(grads)  # of the scaled, summed gradients
        if seq.skip(None if self.precision.scaler is None else (~torch.isfinite(sq)).float().to(dev)):
            self.zero_grad()
            return seq.skipped()
        inv = seq.inv
        norm, coef = seq.clip(sq * (inv * inv), sharded=any(gr.sharded for gr in self.groups))
        factor = inv * (coef if coef is not None else 1.0)  # what multiplies every gradient element
        ps, gs, ms, vs, wds, outs, written = [], [], [], [], [], [], set()
        for i, (g, m) in enumerate(zip(self.groups, self.master)):
            dst = g.owned_params
            fuse = dst.dtype in (torch.float16, torch.bfloat16, torch.float32) and dst.device.type == "cpu"
            if fuse:
                written.add(i)
            for a, b, wd in self.runs[i]:
                ps.append(m[a:b])
                gs.append(grads[i][a:b])
                ms.append(self.exp_avg[i][a:b])
                vs.append(self.exp_avg_sq[i][a:b])
                wds.append(wd)
                if fuse:
                    outs.append(dst[a:b])
        self.step_count += 1
        self._cpu_adam.step_views(ps, gs, ms, vs, wds, outs if len(outs) == len(ps) else None, lr=lr,
                                  grad_scale=1.0 / factor)
        if len(outs) != len(ps):  # some parameters not written by the kernel (on a GPU): copy those
            written = set()
        self._write_back(skip=written)
        self.zero_grad()
        return seq.done(norm)

    def _norm_over_dims(self, sq: torch.Tensor, grads: list, other: list[int], inv: float) -> torch.Tensor:
        """This rank's share of the squared norm when groups live on different dimensions (``sq``: the
        groups over ``self.ctx``). Every element must count once in the sum over ``self.ctx``'s ranks:
        a sharded group's owned slice is unique; a replicated group is held by every rank of its own
        dimension, so its share is divided by that dimension's size (experts held only by their
        expert-parallel rank then add up over ep)."""
        if not any(self.groups[i].sharded for i in range(len(grads)) if i not in other):
            sq = sq / self.ctx.size
        for i in other:
            g, gr = grads[i], self.groups[i]
            x = g.float() * inv if g.dtype != torch.float32 else g  # fp32 gradients are already unscaled
            part = x.pow(2).sum()
            sq = sq + (part if gr.sharded else part / gr.ctx.size)
        return sq

    def _split_sq(self, grads: list, low: list, inv: float) -> torch.Tensor:
        """This rank's squared norm of its tp-split gradients (part of ``sq``; the step sequence adds
        the other tp ranks' parts)."""
        mine = torch.zeros((), dtype=torch.float32, device=grads[0].device)
        for g, lo, segs in zip(grads, low, self.tp_segments):
            for a, b in segs:
                x = g[a:b].float() * inv if lo else g[a:b]  # fp32 gradients are already unscaled
                mine = mine + x.pow(2).sum()
        return mine

    def _decay(self, lr: float) -> None:
        wd = self.cfg.weight_decay
        if wd:
            for m, segs in zip(self.master, self.decay_segments):
                for a, b in segs:
                    m[a:b].mul_(1 - lr * wd)

    def _adam(self, i: int, grad: torch.Tensor, lr: float, sl: slice = slice(None)) -> None:
        """Fused Adam on group i (``sl`` of it; decay was applied by ``_decay``)."""
        b1, b2 = self.cfg.betas
        m = self.master[i][sl]
        step = torch.tensor(float(self.step_count), device=m.device)  # 1-based step for bias correction
        torch._fused_adamw_([m], [grad], [self.exp_avg[i][sl]], [self.exp_avg_sq[i][sl]], [], [step], lr=lr, beta1=b1,
                            beta2=b2, weight_decay=0.0, eps=self.cfg.eps, amsgrad=False, maximize=False)

    def _write_back(self, skip: set[int] = frozenset()) -> None:
        """Masters into the parameters' dtype (groups in ``skip`` were written by the fused kernel), then
        the zero1/zero2 all-gather of the updated shards."""
        for i, (g, m) in enumerate(zip(self.groups, self.master)):
            dst = g.owned_params
            if m is not dst and i not in skip:
                dst.copy_(m, non_blocking=False)
            if g.sharded and g.stage in (1, 2):
                with _ctx(self.tracker, "temp"):
                    mine = dst.clone()
                g.ctx.all_gather(g.full, mine)

    def zero_grad(self) -> None:
        for g in self.groups:
            g.zero_grads()

    def state_dict(self) -> dict:
        """The live state of this rank's owned ranges (checkpoints load into these tensors in place)."""
        st = {"step": self.step_count, **{name: {str(i): t for i, t in enumerate(getattr(self, name))}
                                          for name in ("master", "exp_avg", "exp_avg_sq")}}
        if self._cpu_adam is not None:
            st["cpu_adam_step"] = self._cpu_adam.step_count
        return st

    @torch.no_grad()
    def load_state_dict(self, st: dict) -> None:
        for name in ("master", "exp_avg", "exp_avg_sq"):
            for i, t in enumerate(getattr(self, name)):
                if st[name][str(i)] is not t:
                    t.copy_(st[name][str(i)])
        self.step_count = int(st["step"])
        if self._cpu_adam is not None:
            self._cpu_adam.step_count = int(st["cpu_adam_step"])
        self._write_back_local()

    def _write_back_local(self) -> None:
        """The masters into the parameters this rank owns (no collective: every rank loaded its own)."""
        for g, m in zip(self.groups, self.master):
            dst = g.owned_params
            if m is not dst:
                dst.copy_(m)


def _decay_runs(n: int, decay: list[tuple[int, int]], wd: float) -> list[tuple[int, int, float]]:
    """[0, n) cut into (start, end, weight decay) runs: ``wd`` on the ``decay`` segments, 0 elsewhere,
    adjacent runs of equal decay merged (the host kernel takes one decay per tensor view)."""
    runs: list[tuple[int, int, float]] = []
    pos = 0
    for a, b in sorted(decay):
        if a > pos:
            runs.append((pos, a, 0.0))
        runs.append((a, b, wd))
        pos = b
    if pos < n:
        runs.append((pos, n, 0.0))
    merged: list[tuple[int, int, float]] = []
    for a, b, w in runs:
        if merged and merged[-1][2] == w and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b, w)
        else:
            merged.append((a, b, w))
    return merged


def _sum_sq(grads: list[torch.Tensor], piece: int = 1 << 12) -> torch.Tensor:
    """Sum of squares of fp32 host gradients in one read, without a gradient-sized temporary and with
    one call per group: the norms of ``piece``-element rows (fp32 accumulation over short rows), their
    squares summed in float64. Relative error ~1e-8 (one fp32 norm or dot over millions of elements
    drifts by 1e-4..1e-3; a Python loop of small calls waits on thread start-ups on a busy machine)."""
    total = torch.zeros((), dtype=torch.float64)
    for g in grads:
        k = g.numel() // piece
        if k:
            total += torch.linalg.vector_norm(g[: k * piece].view(k, piece), dim=1).double().pow(2).sum()
        tail = g[k * piece :]
        total += torch.dot(tail, tail).double()
    return total.float()

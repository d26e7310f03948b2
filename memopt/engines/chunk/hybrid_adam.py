"""The chunk engine's optimizer: AdamW over chunk lists, on the host or (Hybrid Adam) on the device.

For every trainable parameter chunk there is a group of three fp32 optimizer chunks of the same
size: master weights, momentum, variance (in fp32 mode too: under gradient reuse the payload holds
the gradients after the backward, and the parameters come back from the master). They start on the host. With
``hybrid_adam``, at the end of warm-up ``place_on_device(margin)`` moves as many groups to the device
as ``margin_use_ratio * margin`` holds (capped by ``hybrid_adam.max_device_chunks``); those are
updated there (``torch._fused_adamw_``), the rest on the host by ``CPUAdamW``. Without it every
group stays on the host (PatrickStar without ``--use_hybrid_adam``).

With 2+ ranks a rank holds groups for its own chunks only (comm.py); the overflow flag and the
squared gradient norm are all-reduced, and the gradients (sums over ranks) are divided by W at the
step, as in the memopt engine.

The step is ``ShardedAdamW``'s math in the same order, so the trajectories match the memopt engine's:
overflow check (fp16) -> unscale -> global-norm clip -> decoupled weight decay on matrices and
embeddings (ndim >= 2) -> Adam -> write the master back into the parameter chunk, wherever that
chunk is (no chunk is moved for the step). Gradients are read from the parameter chunk (its payload
under reuse, else its companion) and converted to fp32 where the group lives, one chunk at a time in
two streaming passes (``step``): the step's ``temp`` is one fp32 chunk on each side, never a rank's
whole gradient. The companions are freed afterwards.
"""
from __future__ import annotations

import contextlib

import torch

from memopt.engines.chunk.chunk import DEVICE, HOST, Chunk
from memopt.engines.chunk.manager import ChunkManager
from memopt.optim.cpu_adam import CPUAdamW
from memopt.optim.step import StepResult, StepSequence
from memopt.strategies.precision import Precision


def groups_that_fit(margin: int, group_bytes: int, groups: int, ratio: float, cap: int | None) -> int:
    """Hybrid Adam's placement rule: ``floor(ratio * margin / group bytes)`` optimizer groups on the
    device, at most ``groups`` and ``cap`` (the planner applies the same rule to a deeper model)."""
    if margin <= 0 or group_bytes <= 0:
        return 0
    n = min(int(ratio * margin) // group_bytes, groups)
    return n if cap is None else min(n, cap)


class ChunkAdam:
    def __init__(self, mgr: ChunkManager, cfg, precision: Precision, dim, tracker, hybrid=None, margin_use_ratio: float = 0.8,
                 cpu_impl: str = "auto"):
        self.mgr, self.cfg, self.precision, self.dim, self.tracker = mgr, cfg, precision, dim, tracker
        self.hybrid, self.margin_use_ratio = hybrid, margin_use_ratio
        self.most = None  # the most groups the warm-up's measured moments allow on the device (place_on_device)
        self.step_count = 0
        self.groups: list[tuple[Chunk, Chunk, Chunk, Chunk]] = []  # (param, master, exp_avg, exp_avg_sq)
        self.decay: list[list[tuple[int, int]]] = []
        # Hybrid Adam's placement decided before step 0 (strategy.hybrid_adam.device_groups): those groups
        # are made on the device, so no host memory ever holds them; the warm-up checks the decision
        owned = [c for c in mgr.trainable_chunks if c.tensors]  # padding chunks (no tensors) need no state
        self.at_start = min(len(owned), (hybrid.device_groups or 0) if hybrid is not None else 0)
        for i, c in enumerate(owned):
            where = DEVICE if i < self.at_start else HOST
            os = []
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                o = Chunk(c.index, kind, c.numel, torch.float32, mgr.device, tracker)
                o.allocate(where, zero=kind != "master")
                os.append(o)
            with self._cat("temp", host=where == HOST):
                os[0].data.copy_(c.data)  # fp32 master from the (possibly rounded) parameters
            self.groups.append((c, *os))
            self.decay.append([(t.offset, t.offset + t.numel) for t in c.tensors if len(t.shape) >= 2])
        mgr.os_device_bytes = self.at_start * self.group_bytes
        self._cpu_adam = CPUAdamW([], lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=0.0, impl=cpu_impl)

    def _cat(self, name: str, host: bool = False):
        stack = contextlib.ExitStack()
        stack.enter_context(self.tracker.category(name))
        if host:
            stack.enter_context(self.tracker.host_scope())
        return stack

    # ---- placement ----------------------------------------------------------------------------
    @property
    def group_bytes(self) -> int:
        return sum(o.payload_bytes for o in self.groups[0][1:]) if self.groups else 0

    @property
    def device_groups(self) -> int:
        return sum(g[1].where == DEVICE for g in self.groups)

    def place_on_device(self, margin: int, hard_margin: int | None = None) -> int:
        """Hybrid Adam at the end of warm-up: the first ``floor(margin_use_ratio * margin / group bytes)``
        groups on the device (PatrickStar's rule: the margin left with every parameter chunk the device
        may hold at once), the others on the host. Groups placed before step 0 (a plan's decision) stay
        up to ``floor(hard_margin / group bytes)`` (``hard_margin``: the device budget less the most a
        moment needs with every chunk it does not compute with evicted, ``ChunkManager.hard_need``; no
        ratio, the budget is already a share of the device); beyond that they go back to the host."""
        if self.hybrid is None or not self.groups:
            return 0
        cap, count = self.hybrid.max_device_chunks, len(self.groups)
        n = groups_that_fit(margin, self.group_bytes, count, self.margin_use_ratio, cap)
        self.most = n if hard_margin is None else max(n, groups_that_fit(hard_margin, self.group_bytes, count, 1.0, cap))
        n = max(n, min(self.device_groups, self.most))
        for i, g in enumerate(self.groups):
            for o in g[1:]:
                o.move(DEVICE if i < n else HOST)
        self.mgr.os_device_bytes = n * self.group_bytes
        self.mgr._note_peak()
        return n

    # ---- step ---------------------------------------------------------------------------------
    def _fp32_grad(self, c: Chunk, dev: torch.device, host: bool) -> torch.Tensor:
        """The chunk's gradient in fp32 where its optimizer group lives (zeros if it got none)."""
        with self._cat("temp", host=host):
            if c.holds_grad:
                x = torch.empty(c.numel, dtype=torch.float32, device=dev)
                x.copy_(c.grad)
            else:  # no gradient this step (an unused parameter): zeros keep Adam's math uniform
                x = torch.zeros(c.numel, dtype=torch.float32, device=dev)
        return x

    @torch.no_grad()
    def step(self, lr: float) -> StepResult:
        """Two streaming passes over the groups, one fp32 gradient chunk alive at a time wherever the
        group lives: (1) overflow vote and squared norm, (2) unscale, clip, decay, Adam, write back.
        Each pass converts the chunk's low-precision gradient again (a conversion is cheaper than
        keeping a rank's whole fp32 gradient, 4 B/param, for the second pass)."""
        comm = self.mgr.comm
        # gradients are sums over ranks: mean, and unscale, in one factor
        seq = StepSequence(self.precision, self.cfg.grad_clip, self.dim, summed_over=self.dim.size, device=self.mgr.device)
        # the step is a traced moment: room for one fp32 chunk per device-side group
        dev_groups = [g for g in self.groups if g[1].where == DEVICE]
        extra = self.groups[0][1].payload_bytes if dev_groups else 0
        self.mgr.ensure([], ("step", "adam"), extra=extra)
        overflow, sq = self._norm_pass(seq.inv)
        if seq.skip(overflow):  # every rank owns part of the gradient: the vote and the norm are global
            self._refresh_params(only_reused=True)
            self.zero_grad()
            return seq.skipped()
        norm, coef = seq.clip(sq, sharded=comm is not None)
        self.step_count += 1
        for group, segs in zip(self.groups, self.decay):
            self._apply(group, segs, seq.inv, coef, lr)
        self.zero_grad()
        return seq.done(norm)

    def _norm_pass(self, inv: float) -> tuple[bool, torch.Tensor]:
        """(overflow, squared norm of the unscaled gradients) of this rank's chunks, one chunk at a time.
        The square is taken in place (``pow_``: the same values as ``pow``), so a pass holds one fp32
        chunk. Overflow: a chunk whose sum of squares is not finite, i.e. one holding an inf or a NaN,
        found without a chunk-sized boolean temporary (finite fp16 gradients are at most 65504; unscaled
        by ``inv`` = 1 / (loss scale x W) their squares summed over a chunk of 1e9 elements stay below
        fp32's maximum for any loss scale above 1e-5)."""
        sq = torch.zeros((), dtype=torch.float32)
        for c, master, _, _ in self.groups:
            if not c.holds_grad:
                continue
            on_dev = master.where == DEVICE
            x = self._fp32_grad(c, master.data.device, host=not on_dev)
            if inv != 1.0:
                x.mul_(inv)
            with self._cat("temp", host=not on_dev):
                part = x.pow_(2).sum().cpu()
            del x
            # .all(): a 0-dim result still, and the planner's healthy answer for a value it cannot compute
            if self.precision.scaler is not None and not bool(torch.isfinite(part).all()):
                return True, sq
            sq = sq + part
        return False, sq

    def _apply(self, group, segs, inv: float, coef: float | None, lr: float) -> None:
        """One group's update where it lives (device: ``torch._fused_adamw_``, host: ``CPUAdamW``), then
        its parameters are written back from the master into the parameter chunk, wherever that is
        (with gradient reuse this overwrites the gradients the step has just consumed)."""
        c, master, m, v = group
        on_dev = master.where == DEVICE
        wd = self.cfg.weight_decay
        b1, b2 = self.cfg.betas
        x = self._fp32_grad(c, master.data.device, host=not on_dev)
        if inv != 1.0 and c.holds_grad:
            x.mul_(inv)
        if coef is not None:
            x.mul_(coef)
        p = master.data
        if wd:
            for a, b in segs:
                p[a:b].mul_(1 - lr * wd)
        if on_dev:
            step_t = torch.tensor(float(self.step_count), device=p.device)
            torch._fused_adamw_([p], [x], [m.data], [v.data], [], [step_t], lr=lr, beta1=b1, beta2=b2,
                                weight_decay=0.0, eps=self.cfg.eps, amsgrad=False, maximize=False)
        else:  # element-wise kernel: the same bits per element whether called per chunk or for all at once
            ca = self._cpu_adam
            ca.step_count = self.step_count - 1
            ca.step_views([p], [x], [m.data], [v.data], [0.0], lr=lr)
        del x
        c.data.copy_(master.data)

    def _refresh_params(self, only_reused: bool) -> None:
        """Parameters from the master (a skipped step under gradient reuse: the payloads hold gradients)."""
        for c, master, _, _ in self.groups:
            if c.grad_in_payload or not only_reused:
                c.data.copy_(master.data)

    def zero_grad(self) -> None:
        for c in self.mgr.chunks:
            c.free_grad()

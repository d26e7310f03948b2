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
chunk is (no chunk is moved for the step). The norm pass reads every chunk's gradient where it is, in
its dtype, without a copy. A host group is then one ``CPUAdamW`` pass per chunk (gradients read in the
chunk's dtype; unscale, clip, decay and the parameters' write-back in the same pass); a device chunk's
gradients reach it through two host staging buffers of the payload dtype (``staging.py``), so the
step's host ``temp`` is two chunks of that dtype, never a rank's whole gradient. A device group takes
one fp32 chunk of device ``temp``. The companions are freed afterwards.
"""
from __future__ import annotations

import contextlib
import math

import torch

from memopt.engines.chunk.chunk import DEVICE, HOST, Chunk
from memopt.engines.chunk.manager import ChunkManager
from memopt.engines.chunk.staging import HostStaging
from memopt.optim.cpu_adam import CPUAdamW, sumsq
from memopt.optim.step import StepResult, StepSequence
from memopt.strategies.precision import Precision


def groups_that_fit(margin: int, group_bytes: int, groups: int, ratio: float, cap: int | None) -> int:
    """Hybrid Adam's placement rule: ``floor(ratio * margin / group bytes)`` optimizer groups on the
    device, at most ``groups`` and ``cap`` (the planner applies the same rule to a deeper model)."""
    if margin <= 0 or group_bytes <= 0:
        return 0
    n = min(int(ratio * margin) // group_bytes, groups)
    return n if cap is None else min(n, cap)


def decay_cuts(c: Chunk, wd: float) -> list[tuple[int, int, float]]:
    """``[(start, end, weight decay)]`` covering the chunk in order, cut where the decay changes: ``wd`` on
    matrices and embeddings (ndim >= 2), 0 on vectors, the padding and the gaps."""
    cuts: list[list] = []
    at = 0
    for t in sorted(c.tensors, key=lambda t: t.offset):
        if len(t.shape) >= 2 and wd:
            if t.offset > at:
                cuts.append([at, t.offset, 0.0])
            cuts.append([t.offset, t.offset + t.numel, wd])
            at = t.offset + t.numel
    if at < c.numel:
        cuts.append([at, c.numel, 0.0])
    merged: list[list] = []
    for a, b, w in cuts:
        if merged and merged[-1][2] == w and merged[-1][1] == a:
            merged[-1][1] = b
        else:
            merged.append([a, b, w])
    return [tuple(x) for x in merged]


class ChunkAdam:
    def __init__(self, mgr: ChunkManager, cfg, precision: Precision, dim, tracker, hybrid=None, margin_use_ratio: float = 0.8,
                 cpu_impl: str = "auto"):
        self.mgr, self.cfg, self.precision, self.dim, self.tracker = mgr, cfg, precision, dim, tracker
        self.hybrid, self.margin_use_ratio = hybrid, margin_use_ratio
        self.most = None  # the most groups the warm-up's measured moments allow on the device (place_on_device)
        self.step_count = 0
        self.groups: list[tuple[Chunk, Chunk, Chunk, Chunk]] = []  # (param, master, exp_avg, exp_avg_sq)
        self.cuts: list[list[tuple[int, int, float]]] = []  # per group: (start, end, weight decay) covering the chunk
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
            self.cuts.append(decay_cuts(c, cfg.weight_decay))
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
        """(1) overflow vote and squared norm, read where each gradient is, without a copy; (2) unscale,
        clip, decay, Adam and the parameters' write-back: device groups one fp32 chunk at a time, host
        groups in one CPUAdamW pass per chunk that reads the gradients in their dtype (``_host_pass``)."""
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
        scale = seq.inv * (1.0 if coef is None else coef)  # one factor: mean over ranks, unscale, clip
        host = []
        for group, cuts in zip(self.groups, self.cuts):
            if group[1].where == DEVICE:
                self._apply_on_device(group, cuts, scale, lr)
            else:
                host.append((group, cuts))
        self._host_pass(host, scale, lr)
        self.zero_grad()
        return seq.done(norm)

    def _norm_pass(self, inv: float) -> tuple[bool, torch.Tensor]:
        """(overflow, squared norm of the unscaled gradients) of this rank's chunks. Each chunk's sum of
        squares is taken where its gradient is, in its dtype: on a CUDA device by ``vector_norm`` (fp32
        accumulation in the reduction, no copy), on the host by ``cpu_adam.sumsq`` (double accumulation,
        no copy). Overflow: a sum that is not finite, i.e. an inf or a NaN in some chunk (finite fp16
        gradients are at most 65504, and their squares summed in fp32 or double stay finite)."""
        on_host, on_dev = [], []
        for c, _, _, _ in self.groups:
            if c.holds_grad:
                g = c.grad
                (on_dev if g.device.type == "cuda" else on_host).append(g)
        total = sumsq(on_host) if on_host else 0.0
        if on_dev:
            norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in on_dev])
            total += float(norms.double().pow(2).sum())
        sq = torch.tensor(total * inv * inv, dtype=torch.float32)
        return self.precision.scaler is not None and not math.isfinite(total), sq

    def _apply_on_device(self, group, cuts, scale: float, lr: float) -> None:
        """A group on the device: its fp32 gradient (one chunk of temp), decay, ``torch._fused_adamw_``,
        and the parameters written back from the master into the parameter chunk, wherever that is."""
        c, master, m, v = group
        b1, b2 = self.cfg.betas
        x = self._fp32_grad(c, master.data.device, host=False)
        if scale != 1.0 and c.holds_grad:
            x.mul_(scale)
        p = master.data
        for a, b, wd in cuts:
            if wd:
                p.narrow(0, a, b - a).mul_(1 - lr * wd)
        step_t = torch.tensor(float(self.step_count), device=p.device)
        torch._fused_adamw_([p], [x], [m.data], [v.data], [], [step_t], lr=lr, beta1=b1, beta2=b2,
                            weight_decay=0.0, eps=self.cfg.eps, amsgrad=False, maximize=False)
        del x
        c.data.copy_(master.data)

    def _host_pass(self, items, scale: float, lr: float) -> None:
        """The host groups, one ``CPUAdamW`` call per chunk that reads the gradients in the chunk's dtype,
        unscales, clips, decays, updates master/momentum/variance and writes the new parameters in the
        chunk's dtype, in one pass (the kernel's element-wise math: the same bits per element whatever the
        split). A parameter chunk on the host is read and written in place (under gradient reuse its
        payload holds the gradients and receives the parameters). One on the device goes through a host
        staging buffer of its dtype (``HostStaging``): gradients copied in, parameters written over them,
        copied back; two buffers, so on CUDA the copies of the neighbouring chunks overlap this chunk's
        pass. A chunk without a gradient this step is updated with zeros, as the memopt engine does."""
        if not items:
            return
        ca = self._cpu_adam
        staged = [it for it in items if it[0][0].where == DEVICE]
        for (c, master, m, v), cuts in items:
            if c.where == DEVICE:
                continue
            if c.holds_grad:
                g = c.grad
            else:
                with self._cat("temp", host=True):
                    g = torch.zeros(c.numel, dtype=c.dtype)
            self._cpu_step(ca, (master, m, v), cuts, g, c.data, scale, lr)
            del g
        if not staged:
            return
        numel = max(it[0][0].numel for it in staged)
        with self._cat("temp", host=True):
            st = HostStaging(staged[0][0][0].data.device, numel, staged[0][0][0].dtype)
        first = staged[0][0][0]
        st.fetch(0, first.grad if first.holds_grad else None)
        for k, ((c, master, m, v), cuts) in enumerate(staged):
            if k + 1 < len(staged):
                nxt = staged[k + 1][0][0]
                st.fetch(k + 1, nxt.grad if nxt.holds_grad else None)
            buf = st.host_view(k, c.numel)
            if not c.holds_grad:
                buf.zero_()
            self._cpu_step(ca, (master, m, v), cuts, buf, buf, scale, lr)
            st.put(k, c.data)
        st.finish()
        del st

    def _cpu_step(self, ca: CPUAdamW, states, cuts, g: torch.Tensor, out: torch.Tensor, scale: float, lr: float) -> None:
        """``CPUAdamW`` over one chunk, cut where the weight decay changes (``self.cuts``)."""
        views = [[t.narrow(0, a, b - a) for a, b, _ in cuts] for t in (*(o.data for o in states), g, out)]
        ca.step_count = self.step_count - 1
        ca.step_views(views[0], views[3], views[1], views[2], [wd for _, _, wd in cuts], out=views[4], lr=lr,
                      grad_scale=1.0 / scale)

    def _refresh_params(self, only_reused: bool) -> None:
        """Parameters from the master (a skipped step under gradient reuse: the payloads hold gradients)."""
        for c, master, _, _ in self.groups:
            if c.grad_in_payload or not only_reused:
                c.data.copy_(master.data)

    def zero_grad(self) -> None:
        for c in self.mgr.chunks:
            c.free_grad()

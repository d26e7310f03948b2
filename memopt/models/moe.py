"""A Mixture-of-Experts MLP in one readable file: top-k router, capacity, dispatch, experts, combine.

Switch Transformer (Fedus et al. 2021) with ``top_k=1``, GShard (Lepikhin et al. 2020) with
``top_k=2``, the router z-loss of ST-MoE (Zoph et al. 2022). It replaces a block's dense MLP through
the ``mlp`` slot (``+strategy=moe``, ``memopt/strategies/moe.py``).

Shape legend: S tokens in this rank's micro-batch (B * T), C d_model, F expert hidden width, E experts,
k top_k, N capacity (slots per expert per rank), P expert-parallel ranks, El = E / P local experts.

1. Router, in fp32 whatever the autocast: logits = x W_r^T (S, E), probs = softmax(logits).
2. Each token picks its k most probable experts. Combine weights: the chosen probability itself for
   k = 1 (Switch), the chosen probabilities renormalised to sum to 1 for k >= 2 (GShard).
3. Capacity N = max(min_capacity, ceil(capacity_factor * S * k / E)) (``eval_capacity_factor`` in
   eval mode); ``drop_tokens=False`` makes N the largest expert load (dropless; the maximum over the
   expert-parallel ranks, so that every rank's buffers have one shape). Assignments queue at their
   expert in the order (choice j, token s): every token's first choice before any second choice
   (GShard), so second choices are dropped first. An assignment whose position is >= N is dropped:
   it contributes nothing, the token keeps its residual stream.
4. Dispatch: the kept assignments' inputs are copied into an (E, N, C) buffer. With expert
   parallelism (P > 1), an all_to_all over ``ep`` sends expert e's rows to the rank holding e; each
   rank runs its El experts on the (P * N) rows it received and a second all_to_all returns them.
5. Combine: y_s = sum_j w_sj * expert_{e_sj}(x_s) over the kept assignments of token s.

Losses (weighted by the strategy's coefficients and added to the training loss through
``Model.aux_loss``):
- load balancing (Switch eq. 4, GShard's l_aux): E * sum_e f_e * P_e with f_e the fraction of tokens
  whose first choice is e and P_e the mean router probability of e (1.0 when perfectly balanced);
- router z-loss (ST-MoE eq. 5): mean over tokens of logsumexp(logits_s)^2.

Parameters: ``router.weight`` (E, C) and ``experts.<e>.fc`` / ``experts.<e>.proj`` named with the
global expert index e, so each expert gets the dense MLP's init rules from (seed, name) on whichever
rank holds it (``proj`` weights: the residual-projection std).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from memopt.memory.tracker import active_category


class Expert(nn.Module):
    """One expert: the dense MLP's structure, fc -> gelu(tanh) -> proj (-> dropout)."""

    def __init__(self, d_model: int, d_ff: int, bias: bool, dropout: float):
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff, bias=bias)
        self.proj = nn.Linear(d_ff, d_model, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (rows, C) -> (rows, F) -> (rows, C)
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


def capacity(tokens: int, num_experts: int, top_k: int, factor: float, min_capacity: int) -> int:
    """Slots per expert: max(min_capacity, ceil(factor * tokens * top_k / num_experts))."""
    return max(min_capacity, math.ceil(factor * tokens * top_k / num_experts))


def route(logits: torch.Tensor, top_k: int, cap: int | None):
    """The gating decisions for router logits (S, E) (fp32).

    Returns (probs (S, E), experts (S, k), weights (S, k), position (S, k), keep (S, k) bool, load (E,)):
    ``position`` is each assignment's place in its expert's queue (first choices of every token first);
    ``cap=None`` keeps everything (dropless: the caller sets the capacity to the largest load).
    """
    S, E = logits.shape
    probs = F.softmax(logits, dim=-1)  # (S, E)
    top_p, experts = probs.topk(top_k, dim=-1)  # (S, k) each, most probable first
    weights = top_p if top_k == 1 else top_p / top_p.sum(dim=-1, keepdim=True)  # Switch | GShard
    onehot = F.one_hot(experts, E).transpose(0, 1).reshape(top_k * S, E)  # (k*S, E), choice-major
    position = ((onehot.cumsum(0) - 1) * onehot).sum(-1).view(top_k, S).t()  # (S, k)
    load = onehot.sum(0)  # (E,) assignments per expert before dropping
    keep = torch.ones_like(position, dtype=torch.bool) if cap is None else position < cap
    return probs, experts, weights, position, keep, load


def dropless_capacity(load: torch.Tensor, ep=None, tokens: int | None = None) -> int:
    """Dropless capacity: the largest expert load ``load`` (E,), the maximum over the expert-parallel
    group ``ep`` (a Dim, or None) so every rank's buffers have one shape; ``tokens`` (S) bounds it (top-k
    choices are distinct experts, so no expert gets more than S). A value read (``.item()``):
    the planner, whose fake tensors have no values, answers it with its planned routing
    (``memopt/planner/routing.py``), which is why it is a function of its own."""
    top = load.max().reshape(1).clone()
    if ep is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ep.group)
    n = int(top.item())
    return max(min(n, tokens) if tokens else n, 1)


def kept(keep: torch.Tensor, slots: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each (S, k) tensor's kept assignments ``t[keep]`` (A,), in (token, choice) order; ``slots``
    (E x N) bounds A. A boolean mask's result has a data-dependent length, which fake tensors do not
    have: the planner replaces this function by one of its planned count (``memopt/planner/routing.py``)."""
    return tuple(t[keep] for t in tensors)


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch / GShard auxiliary loss E * sum_e f_e P_e (f from the first choices)."""
    E = probs.size(-1)
    f = F.one_hot(experts[:, 0], E).to(probs.dtype).mean(0)  # (E,) fraction of tokens whose first choice is e
    P = probs.mean(0)  # (E,) mean router probability
    return E * (f * P).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean_s logsumexp(logits_s)^2."""
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


class _AllToAll(torch.autograd.Function):
    """Equal-split all_to_all over a process group; its gradient is the reverse all_to_all. The
    receive buffers count as ``comm`` in the memory tracker (forward and backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        with active_category("comm"):
            out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with active_category("comm"):
            out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


class Router(nn.Linear):
    """The gate's linear map, computed in fp32 whatever the autocast or the parameter dtype (float64
    stays float64: the reference tests). A module call, not ``F.linear`` on its weight, so engines that
    act through module hooks (the chunk engine fetches a module's chunks before its forward) see it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return router_logits(x, self.weight)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T in fp32 (float64 stays float64), with autocast off: the gate's logits."""
    rdt = torch.promote_types(x.dtype, torch.float32)
    with torch.autocast(device_type=x.device.type, enabled=False):
        return F.linear(x.to(rdt), weight.to(rdt))


class RoutingStats:
    """Routing statistics of a model's MoE layers, summed over the training forwards since the last
    ``report()`` (the trainer logs them per step through ``Model.step_metrics``).

    ``dim``: the data-parallel dimension the report averages over (every rank calls ``report``)."""

    def __init__(self, num_experts: int, dim=None):
        self.num_experts, self.dim = num_experts, dim
        self.sums: dict[str, torch.Tensor] = {}  # layer name -> [aux, z, dropped, forwards, load_0..E-1]

    def add(self, layer: str, aux: float, z: float, dropped: float, load: torch.Tensor) -> None:
        row = torch.cat([torch.tensor([aux, z, dropped, 1.0], dtype=torch.float64), load.double().cpu()])
        self.sums[layer] = self.sums[layer] + row if layer in self.sums else row

    def report(self) -> dict:
        """{"moe": {aux_loss, z_loss, dropped_frac (means over layers and forwards), load: {layer: {e<i>: fraction}}}}."""
        if not self.sums:
            return {}
        names = sorted(self.sums)
        table = torch.stack([self.sums[n] for n in names])  # (layers, 4 + E)
        if self.dim is not None and self.dim.enabled:
            self.dim.all_reduce_(table)
        self.sums = {}
        n = table[:, 3:4].clamp(min=1)
        mean = table[:, :3] / n  # (layers, 3) per-forward means
        load = table[:, 4:] / table[:, 4:].sum(-1, keepdim=True).clamp(min=1)  # (layers, E) fraction per expert
        out = {k: float(mean[:, i].mean()) for i, k in enumerate(("aux_loss", "z_loss", "dropped_frac"))}
        out["load"] = {name: {f"e{e}": float(v) for e, v in enumerate(row)} for name, row in zip(names, load)}
        return {"moe": out}


class AuxLossPart:
    """The model's auxiliary-loss protocol (``memopt.models.base``) for a routed layer: ``forward``
    stores its weighted loss term in ``_aux`` and its statistics in ``_pending``; ``take_aux_loss``
    hands the term out once and commits the statistics to ``stats`` (so a checkpoint recomputation,
    which reruns the forward, is not counted twice). Shared by memopt's MoE and the DeepSpeed-MoE
    adapter of ``engine=deepspeed``."""

    _aux: torch.Tensor | None = None
    _pending: tuple | None = None
    stats: RoutingStats | None = None
    name: str = "moe"

    def take_aux_loss(self) -> torch.Tensor | None:
        """The weighted loss term of the last training forward (once), committing its statistics."""
        aux, self._aux = self._aux, None
        if self._pending is not None and self.stats is not None:
            a, z, d, load = self._pending
            self.stats.add(self.name, float(a), float(z), float(d), load)
        self._pending = None
        return aux


class MoE(AuxLossPart, nn.Module):
    """The MoE MLP: (B, T, C) -> (B, T, C). See the module docstring for the algorithm.

    ``ep``: the expert-parallel dimension (``memopt.parallel.Dim``; None or size 1: every expert here).
    ``stats``: a ``RoutingStats`` shared by the model's MoE layers (None: no statistics).
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 4, drop_tokens: bool = True,
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, bias: bool = True, dropout: float = 0.0,
                 ep=None, stats: RoutingStats | None = None, name: str = "moe"):
        super().__init__()
        P = ep.size if ep is not None else 1
        if num_experts % P:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {P}")
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity, self.drop_tokens = min_capacity, drop_tokens
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.ep, self.stats, self.name = ep, stats, name
        self.local = num_experts // P  # El
        first = (ep.rank if ep is not None else 0) * self.local
        self.router = Router(d_model, num_experts, bias=False)  # (E, C)
        self.experts = nn.ModuleDict({str(e): Expert(d_model, d_ff, bias, dropout) for e in range(first, first + self.local)})
        if P > 1:  # each expert lives on the ranks of its edp group only: data-parallel over those
            self.experts.dp_dim = "edp"

    @property
    def parallel(self) -> bool:
        return self.ep is not None and self.ep.enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        S, E, k = B * T, self.num_experts, self.top_k
        xs = x.reshape(S, C)  # (S, C)
        logits = self.router(xs)  # (S, E) fp32
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        cap = capacity(S, E, k, factor, self.min_capacity) if self.drop_tokens else None
        probs, experts, weights, position, keep, load = route(logits, k, cap)
        if cap is None:  # dropless: the largest load, agreed by the expert-parallel ranks
            cap = dropless_capacity(load, self.ep if self.parallel else None, S)

        # dispatch: kept assignments -> slot (expert * N + position) of an (E * N, C) buffer
        token, e_kept, p_kept, w_kept = kept(keep, E * cap, torch.arange(S, device=x.device).unsqueeze(1).expand(S, k),
                                             experts, position, weights)  # (A,) each: the kept assignments
        slot = e_kept * cap + p_kept  # (A,)
        buf = xs.new_zeros(E * cap, C).index_copy(0, slot, xs[token])  # (E*N, C)
        out = self._experts(buf.view(E, cap, C)).reshape(E * cap, C)  # (E*N, C)

        # combine: y_s = sum_j w_sj * out[slot_sj]
        w = w_kept.to(out.dtype).unsqueeze(1)  # (A, 1)
        y = xs.new_zeros(S, C, dtype=out.dtype).index_add(0, token, out[slot] * w)  # (S, C)

        if self.training and torch.is_grad_enabled():
            aux, zl = load_balancing_loss(probs, experts), z_loss(logits)
            self._aux = self.aux_loss_coef * aux + self.z_loss_coef * zl
            dropped = 1.0 - keep.sum() / keep.numel()
            self._pending = (aux.detach(), zl.detach(), dropped.detach(), load.detach())
        return y.view(B, T, C).to(x.dtype)

    def _experts(self, buf: torch.Tensor) -> torch.Tensor:
        """(E, N, C) -> (E, N, C): each expert on its slots, across the expert-parallel ranks."""
        if not self.parallel:
            return torch.stack([self.experts[str(e)](buf[e]) for e in range(self.num_experts)])
        E, N, C = buf.shape
        P, El = self.ep.size, self.local
        recv = _AllToAll.apply(buf, self.ep.group).view(P, El, N, C)  # from each rank: its rows for my experts
        first = self.ep.rank * El
        done = torch.stack([self.experts[str(first + e)](recv[:, e].reshape(P * N, C)).view(P, N, C)
                            for e in range(El)], dim=1)  # (P, El, N, C)
        return _AllToAll.apply(done.reshape(E, N, C), self.ep.group)  # my tokens' rows, back from each expert
